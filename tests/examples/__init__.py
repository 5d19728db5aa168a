"""Tests of the examples under the repository's top-level ``examples/``.

Under pytest's default ``prepend`` import mode this package is imported as ``examples`` (``tests/`` has no
``__init__.py``) and would shadow the repository's ``examples/`` namespace package. Adding that directory to this
package's search path lets ``examples.char_lm`` resolve either way, and also when ``tests`` becomes a package.
"""

from pathlib import Path

__path__.append(str(Path(__file__).resolve().parents[2] / "examples"))
