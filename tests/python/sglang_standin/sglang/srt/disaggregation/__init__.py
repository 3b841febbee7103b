"""A stand-in of SGLang's package layout for test_sglang_hook.py."""
