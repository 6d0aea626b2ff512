"""The one error a bad algorithm setting raises, carrying the setting's name.

The settings classes of ``algorithms/`` know their own field names, not where the config tree
puts them; the config layer catches ``SettingError`` and names the full key
(``f"algorithm.<section>.{err.setting}"``).
"""

from __future__ import annotations


class SettingError(ValueError):
    """A bad value (or a bad combination) of one setting; ``setting`` is its field name."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
