"""The JSON the server reads and writes, as types: a value read out of a body (`JSONValue`,
narrowed before use) and a body built to be sent (`JSONBody`: any value json.dumps takes, its
shape given where it is built)."""

from __future__ import annotations

from typing import TypeAlias

JSONValue: TypeAlias = "str | int | float | bool | None | list[JSONValue] | dict[str, JSONValue]"
JSONObject: TypeAlias = "dict[str, JSONValue]"
JSONBody: TypeAlias = "dict[str, object]"
