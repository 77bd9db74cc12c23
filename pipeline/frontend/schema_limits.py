"""A JSON schema's cost and sense, measured before llguidance compiles it (``grammar_limits`` says why).

The schema is walked as a graph (subschemas by keyword, local ``$ref`` s resolved as JSON pointers or
anchors), iteratively, so no document is too deep to inspect:

* depth: the longest path from the root through subschemas and ``$ref`` s (recursion stops at a
  schema already on the path) is at most ``MAX_DEPTH``: a 5,000-long ``$ref`` chain overflows the
  compiler's stack;
* every ``pattern`` (and ``patternProperties`` key) passes the regex limits;
* every schema reachable from the root admits some finite value. A ``$ref`` cycle with no way out
  (``a -> b -> a``, or ``{"$ref": "#"}``) admits none; llguidance would let the model open such a value
  and then allow no token at all, mid-answer. A literal ``false`` is fine where it is optional
  (``additionalProperties: false``): llguidance leaves it out.
"""

from __future__ import annotations

from typing import Any, Iterator
from urllib.parse import unquote

from strata.pipeline.frontend.grammar_limits import MAX_DEPTH, GrammarLimitError, check_regex

_ONE = ("additionalProperties", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "items")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class _Node:
    """One subschema: where it sits and what its admitting a value depends on."""

    __slots__ = ("pointer", "schema", "children", "refs", "productive")

    def __init__(self, pointer: str, schema: Any) -> None:
        self.pointer = pointer
        self.schema = schema
        self.children: list[int] = []  # ids of its subschemas and of the schemas its $ref names
        self.refs: list[int] = []  # ids of the schemas its $ref names
        self.productive = schema is not False


def check_schema(schema: Any) -> None:
    """GrammarLimitError if ``schema`` (parsed JSON) is too deep, repeats too much, or admits no value."""
    nodes = _collect(schema)
    _check_depth(nodes, id(schema))
    _check_productive(nodes, id(schema))


def _subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for key in _ONE:
        if isinstance(schema.get(key), (dict, bool)):
            yield key, schema[key]
    for key in _LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                if isinstance(sub, (dict, bool)):
                    yield f"{key}/{i}", sub
    for key in _MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if isinstance(sub, (dict, bool)):
                    yield f"{key}/{_escape(str(name))}", sub


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _collect(root: Any) -> dict[int, _Node]:
    """Every subschema by id, with its children and its $ref targets (local ones) as edges."""
    nodes: dict[int, _Node] = {}
    anchors: dict[str, Any] = {}
    refs: list[tuple[_Node, str]] = []
    stack: list[tuple[str, Any]] = [("#", root)]
    while stack:
        pointer, schema = stack.pop()
        if id(schema) in nodes:
            continue
        node = nodes[id(schema)] = _Node(pointer, schema)
        if not isinstance(schema, dict):
            continue
        if isinstance(schema.get("$anchor"), str):
            anchors[schema["$anchor"]] = schema
        if isinstance(schema.get("$ref"), str):
            refs.append((node, schema["$ref"]))
        if isinstance(schema.get("pattern"), str):
            check_regex(schema["pattern"], f"pattern at {pointer}")
        for key in (schema.get("patternProperties") or {}) if isinstance(schema.get("patternProperties"), dict) else ():
            check_regex(str(key), f"patternProperties key at {pointer}")
        for where, sub in _subschemas(schema):
            node.children.append(id(sub))
            stack.append((f"{pointer}/{where}", sub))
    for node, ref in refs:
        target = _resolve(root, ref, anchors)
        if target is not None and id(target) in nodes:
            node.children.append(id(target))
            node.refs.append(id(target))
    return nodes


def _resolve(root: Any, ref: str, anchors: dict[str, Any]) -> Any:
    """The subschema a local ``$ref`` names (``#``, ``#/json/pointer``, ``#anchor``); None otherwise."""
    if not ref.startswith("#"):
        return None  # another document: llguidance refuses those by name
    fragment = unquote(ref[1:])
    if not fragment.startswith("/"):
        return root if not fragment else anchors.get(fragment)
    target = root
    for part in fragment[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


def _check_depth(nodes: dict[int, _Node], root: int) -> None:
    """The longest path from the root, each subschema or $ref one level; a schema already on the path
    (recursion) ends it. Iterative, memoised."""
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[int, int]] = [(root, 0)]  # (node, next child to visit)
    while stack:
        key, child = stack[-1]
        node = nodes[key]
        if child == 0:
            on_path.add(key)
        if child < len(node.children):
            stack[-1] = (key, child + 1)
            nxt = node.children[child]
            if nxt not in depth and nxt not in on_path:
                stack.append((nxt, 0))
            continue
        stack.pop()
        on_path.discard(key)
        depth[key] = 1 + max((depth.get(c, 0) for c in node.children if c not in on_path), default=0)
        if depth[key] > MAX_DEPTH:
            raise GrammarLimitError(f"the JSON schema nests more than {MAX_DEPTH} levels deep (subschemas and $ref "
                                    f"chains) from {node.pointer} down; at most {MAX_DEPTH}")


def _check_productive(nodes: dict[int, _Node], root: int) -> None:
    """Least fixpoint of "admits a finite value", then every dict schema reachable from the root must."""
    for node in nodes.values():
        node.productive = False if isinstance(node.schema, dict) else node.schema is not False
    parents: dict[int, list[int]] = {}
    for key, node in nodes.items():
        for c in node.children:
            parents.setdefault(c, []).append(key)
    work = [key for key, node in nodes.items() if isinstance(node.schema, dict)]
    while work:
        key = work.pop()
        node = nodes[key]
        if node.productive or not _admits_value(node, nodes):
            continue
        node.productive = True
        work.extend(p for p in parents.get(key, ()) if not nodes[p].productive)
    seen, stack = {root}, [root]
    while stack:
        node = nodes[stack.pop()]
        if isinstance(node.schema, dict) and not node.productive:
            raise GrammarLimitError(f"the JSON schema at {node.pointer} admits no value (a $ref cycle with no way "
                                    "out, or a required part that admits none)")
        for c in node.children:
            if c not in seen:
                seen.add(c)
                stack.append(c)


def _admits_value(node: _Node, nodes: dict[int, _Node]) -> bool:
    """Whether ``node`` admits a value, given what its subschemas are known to admit so far. A schema
    without a type but with object (array) keywords counts as an object (array): the stricter reading."""
    schema = node.schema

    def ok(sub: Any) -> bool:
        known = nodes.get(id(sub))
        return known.productive if known is not None else sub is not False

    if not all(nodes[t].productive for t in node.refs):
        return False
    if not all(ok(s) for s in schema.get("allOf") or () if isinstance(s, (dict, bool))):
        return False
    for key in ("anyOf", "oneOf"):
        options = [s for s in schema.get(key) or () if isinstance(s, (dict, bool))]
        if options and not any(ok(s) for s in options):
            return False
    if isinstance(schema.get("enum"), list) and not schema["enum"]:
        return False
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else set()
    if not types:
        types = {"object"} if "properties" in schema or "required" in schema else \
            {"array"} if "items" in schema or "prefixItems" in schema else set()
    if not types or types - {"object", "array"}:
        return True  # a scalar (or any value) can always be written
    return ("object" in types and _object_ok(schema, ok)) or ("array" in types and _array_ok(schema, ok))


def _object_ok(schema: dict[str, Any], ok: Any) -> bool:
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    extra = schema.get("additionalProperties", True)
    for name in schema.get("required") or () if isinstance(schema.get("required"), list) else ():
        if not ok(props[name] if name in props else extra):
            return False
    return True


def _array_ok(schema: dict[str, Any], ok: Any) -> bool:
    need = schema.get("minItems") if isinstance(schema.get("minItems"), int) else 0
    prefix = [s for s in schema.get("prefixItems") or () if isinstance(s, (dict, bool))]
    items = schema.get("items")
    if isinstance(items, list):  # draft 4-7 tuples
        prefix, items = [s for s in items if isinstance(s, (dict, bool))], schema.get("additionalItems")
    if not all(ok(prefix[i]) for i in range(min(need, len(prefix)))):
        return False
    return need <= len(prefix) or items is None or ok(items)
