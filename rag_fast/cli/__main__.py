"""``python -m rag_fast.cli ...``: the ``rag-fast`` command (as torchrun runs it)."""
import sys

from rag_fast.cli import main

sys.exit(main())
