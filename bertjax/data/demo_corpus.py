"""The embedded default corpus: the Python language reference's help topics shipped inside CPython.

`pydoc_data.topics` (part of the standard library, so present offline on every machine that runs bertjax) holds
~0.46 MB of real English prose: 79 documents such as "The if statement" or "Assignment statements". This module
turns them into the original BERT corpus format (one sentence per line, a blank line between documents), dropping
code samples and grammar productions. It is a small demo corpus; real runs point `data.input` at Wikipedia or
their own files.
"""
from __future__ import annotations

import re

from etils import epath

from bertjax.runtime.outputs import replaced_when_whole

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_UNDERLINE = re.compile(r"^[*=\-~^]{3,}$")


def python_doc_documents() -> list[list[str]]:
    """Each help topic as a list of sentences (prose paragraphs only)."""
    import pydoc_data.topics

    documents = []
    for name in sorted(pydoc_data.topics.topics):
        sentences = []
        for paragraph in re.split(r"\n\s*\n", pydoc_data.topics.topics[name]):
            lines = paragraph.splitlines()
            # Code samples, grammar rules and tables are indented; headings are underlined. Keep prose only.
            if not lines or lines[0].startswith((" ", "\t")) or any(_UNDERLINE.match(l.strip()) for l in lines):
                continue
            text = " ".join(line.strip() for line in lines)
            sentences += [s.strip() for s in _SENTENCE_END.split(text) if len(s.split()) >= 3]
        if sentences:
            documents.append(sentences)
    return documents


def write_documents(documents: list[list[str]], path: str) -> str:
    """Writes documents in the original format: one sentence per line, blank line between documents."""
    with replaced_when_whole(path) as partial:
        epath.Path(partial).write_text("\n\n".join("\n".join(doc) for doc in documents) + "\n", encoding="utf-8")
    return path


def write_demo_corpus(directory: str, eval_documents: int = 8) -> tuple[str, str]:
    """(train file, held-out eval file) of the demo corpus in `directory`; the last topics are held out."""
    out = epath.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    documents = python_doc_documents()
    return (write_documents(documents[:-eval_documents], str(out / "train.txt")),
            write_documents(documents[-eval_documents:], str(out / "eval.txt")))
