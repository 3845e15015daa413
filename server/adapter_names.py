"""Adapter names: the one rule that the server, the node agent and the operator check a name
against where it enters, with the standard library only (the node agent and the operator
import this module, so it must never import torch).

An adapter's name goes everywhere: the API's `model` field; a directory under
--adapter-cache-dir and the node agent's cache (`<dir>/<name>/`); a URL path segment
(`POST /v1/adapters/{name}/pin`); a Prometheus label value, where `vllm:lora_requests_info`
joins the running and the waiting adapters with commas and the Gateway API Inference
Extension's endpoint picker splits them on commas again; and a LoRAAdapter object's name. A
name fits all of them when it

    has 1 to 253 characters (a Kubernetes object name's limit; a file name holds 255 bytes),
    holds ASCII letters, digits, ".", "_", "-", "@" and "+" only (no "/", "\\", ",", "%",
        whitespace, control characters or other Unicode),
    starts with a letter or a digit (not ".", "..", a hidden file, nor a "-" read as a flag).

    check_adapter_name("sql-v2")    -> "sql-v2"
    check_adapter_name("a,b")       -> InvalidAdapterName: ... contains ',' ...

Every Kubernetes object name fits, so a LoRAAdapter's name always does; upper case is allowed
for names given to a server directly (`--lora-modules SQL=/adapters/sql`), as vLLM allows them.
"""

from __future__ import annotations

import re

MAX_ADAPTER_NAME_LENGTH = 253
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,252}$"
_NAME = re.compile(ADAPTER_NAME_PATTERN)
_ALLOWED = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@+-")


# A Kubernetes namespace's name (a DNS-1123 label): the node's cache keeps each namespace's
# adapters in a folder of that name (`<cache>/.namespaces/<namespace>/`).
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def is_namespace(name: object) -> bool:
    return isinstance(name, str) and _NAMESPACE.fullmatch(name) is not None


class InvalidAdapterName(ValueError):
    """A name that cannot be an adapter's; the message says which part and why."""


def is_adapter_name(name: object) -> bool:
    # fullmatch: a plain match's "$" would also accept a trailing newline.
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_adapter_name(name: object) -> str:
    """`name` if it fits the rule above; else InvalidAdapterName saying why."""
    if is_adapter_name(name):
        return name  # type: ignore[return-value]
    if not isinstance(name, str):
        raise InvalidAdapterName(f"adapter name {name!r} is not a string")
    if not name:
        raise InvalidAdapterName("adapter name is empty")
    if len(name) > MAX_ADAPTER_NAME_LENGTH:
        raise InvalidAdapterName(f"adapter name {name[:40]!r}... is {len(name)} characters long; "
                                 f"at most {MAX_ADAPTER_NAME_LENGTH}")
    bad = next((c for c in name if c not in _ALLOWED), None)
    if bad == ",":
        why = ("the metric vllm:lora_requests_info lists adapters joined by commas, so the Gateway API "
               "Inference Extension's endpoint picker would split it in two")
    elif bad in ("/", "\\"):
        why = "it is a directory name in the adapter caches and one segment of the /v1/adapters/{name} URLs"
    elif bad is not None:
        why = "use ASCII letters, digits, '.', '_', '-', '@' and '+'"
    else:
        bad = name[0]
        why = "it must start with a letter or a digit (a name starting with '.' is hidden or a path like '..')"
    raise InvalidAdapterName(f"adapter name {name!r} contains {bad!r}: {why}")
