# onnx_helpers.py is imported by the ONNX tests (which skip without onnx); never collect it on its own
collect_ignore = ["onnx_helpers.py"]
