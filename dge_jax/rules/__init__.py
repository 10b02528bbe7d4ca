"""The scoring rules (what each one ranks cache entries by) and the registry that names them."""
