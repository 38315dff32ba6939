"""A toy backend that lives outside tgc/: the proof that a backend is its folder and
nothing else. tests/backends/test_toy_backend.py adds tests/backends/plugins to
`tgc.backends.__path__` and calls `tgc.backends.base.refresh()`; then "toy" is a
registered backend (`tgc.compile(..., backend="toy")`, `tgc run --backend toy`), and
`pytest --backends-from tests/backends/plugins` runs every backend test on it too."""

BACKENDS = {"toy": "tgc.backends.toy.backend:ToyBackend"}
