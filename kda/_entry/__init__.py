"""The entry layer: the public functions, their validation and composition, the adapters' host side."""
