"""Session-wide test setup."""

from jaxrlhf.host_allocator import tune_host_allocator

# As `python -m jaxrlhf.train` does: XLA:CPU reuses its buffers instead of re-mapping them
# on every call, which also shortens the suite.
tune_host_allocator()
