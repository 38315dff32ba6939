"""The tensor IR: every op and elementwise function defined once (ops.py), types, values,
modules, text form, verifier and interpreter.

This package imports nothing else of tgc.
"""
