"""The model-level options: their table, their checks, the validation of a call and the element-wise maps."""
