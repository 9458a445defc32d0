"""The commands of ``roundpipe`` (``roundpipe/cli.py`` picks one): one module per command.

A command module parses its arguments, calls the library (``train/``, ``sim/``, ``partition/``),
prints what it returns and chooses the exit status; what it computes lives in those layers.
``model_args.py`` holds the options ``simulate`` and ``plan`` share.
"""
