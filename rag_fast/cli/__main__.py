"""``python -m rag_fast.cli ...``: the ``rag-fast`` command (as torchrun runs it)."""
from rag_fast.cli import command

command()
