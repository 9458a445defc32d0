"""What the tests share: tiny models, the plain-PyTorch reference runs, the memory oracle, the
data-parallel cases and their worker process, the GPU check's helpers.

Imported as ``support.<module>``: pytest puts ``tests/`` on ``sys.path`` (the benchmarks that use
these modules do the same), so ``from support.tiny_models import make_model``.
"""
