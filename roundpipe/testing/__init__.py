"""Tools for testing roundpipe's behaviour under failure (``faults``): off unless enabled."""
