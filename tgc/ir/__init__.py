"""The tensor IR: types, values, modules, text form, verifier and interpreter.

This package imports nothing else of tgc.
"""
