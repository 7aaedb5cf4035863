"""The research instruments' tests (marked `research`): run from a checkout with
`pytest research/tests`, never by the default run (pyproject's testpaths is `tests`). They
share the suite's model fixtures."""

from tests.conftest import tiny_model, tiny_tok, workdir

__all__ = ["tiny_model", "tiny_tok", "workdir"]
