"""Whether an HF model folder holds a usable tokenizer, from its file names alone (no
transformers: the check runs before any rank starts). Without these files transformers builds an
empty tokenizer of the model's class rather than failing, and every prompt encodes to nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

# Each way a tokenizer is stored: the files it needs (all of them).
TOKENIZER_FORMS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"),
                   ("vocab.txt",))
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def tokenizer_problem(folder: Union[str, Path], chat_template: bool = False) -> Optional[str]:
    """What the folder lacks for a tokenizer (and, with ``chat_template``, for a chat
    template), naming the missing file; None when nothing is missing."""
    folder = Path(folder)
    present = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    if not any(all(name in present for name in form) for form in TOKENIZER_FORMS):
        partial = next((form for form in TOKENIZER_FORMS if any(n in present for n in form)),
                       None)
        if partial is not None:
            missing = [n for n in partial if n not in present]
            return f"{folder} has {', '.join(n for n in partial if n in present)} but no " \
                   f"{', '.join(missing)}: the tokenizer is incomplete"
        return (f"{folder} has no tokenizer: none of tokenizer.json, tokenizer.model, "
                "vocab.json + merges.txt, vocab.txt (copy the tokenizer files of the model)")
    if chat_template and not present & set(CHAT_TEMPLATE_FILES) \
            and not _config_has_template(folder / "tokenizer_config.json"):
        what = "tokenizer_config.json has no chat_template" \
            if "tokenizer_config.json" in present else "there is no tokenizer_config.json"
        return (f"{folder}: data.apply_chat_template=true but {what} (nor "
                f"{' or '.join(CHAT_TEMPLATE_FILES)}); set data.apply_chat_template=false for "
                "plain text")
    return None


def _config_has_template(path: Path) -> bool:
    try:
        return bool(json.loads(path.read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False
