"""Code generators: one package per target. Backends never import each other."""
