"""Session-wide test setup."""

from jaxrlhf.host_allocator import tune_host_allocator

# As `python -m jaxrlhf.train` does, so that the tests run the allocator setting users get.
tune_host_allocator()
