"""IR-to-IR passes and the pass manager. Passes import `tgc.ir` only."""
