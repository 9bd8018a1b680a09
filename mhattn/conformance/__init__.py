"""The conformance suite: every registered backend checked against the reference, per feature.

- :mod:`.cases`: the :class:`~.cases.Case` of one problem and the quick/full generators (from capabilities);
- :mod:`.inputs`: the tensors of a case, drawn from its seed;
- :mod:`.runner`: :func:`~.runner.run_case`, the judged run of one case on one backend;
- :mod:`.tolerance`: the tolerance rule of CONFORMANCE.md;
- :mod:`.suite`: plans, and running them in this process;
- :mod:`.pool`: running them in worker processes (through :mod:`mhattn.isolation`);
- :mod:`.report`: the backend x feature table (text, Markdown, JSON);
- :mod:`.cli`: ``mhattn conformance``.
"""
