"""`not CMD...`: run CMD and succeed exactly when it fails (as in LLVM's lit)."""
import subprocess
import sys

sys.exit(0 if subprocess.run(sys.argv[1:]).returncode != 0 else 1)
