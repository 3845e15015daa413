"""`loraplex-operator`: run the kopf operator (the same as `kopf run -m loraplex.operator`).

    loraplex-operator                        # every namespace
    loraplex-operator --namespace ml -v      # one namespace, debug logs
    loraplex-operator --plan-mirror-namespace loraplex-system   # plans mirrored for the node agents

The environment is read here alone: LORAPLEX_PLAN_MIRROR_NAMESPACE for a
--plan-mirror-namespace the command line leaves out (the chart sets it; `kopf run -m
loraplex.operator` takes no flags of ours, and reads it too, through `mirror_namespace_from_env`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import urllib.parse
from collections.abc import Mapping

import kopf

from loraplex.server.adapter_names import is_namespace

MIRROR_NAMESPACE_ENV = "LORAPLEX_PLAN_MIRROR_NAMESPACE"


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    """Command-line settings of the operator; each flag maps onto one field."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to serve (globs allowed); empty: the whole cluster."""
    verbose: bool = False
    """Debug logging (kopf's and ours)."""
    liveness: str | None = None
    """The liveness endpoint, e.g. http://0.0.0.0:8080/healthz (kopf's, on that address); an
    empty host, http://:8080/healthz, listens on every address of both families (IPv4 and
    IPv6; loraplex.operator.liveness); None: off."""
    plan_mirror_namespace: str | None = None
    """A namespace (the node agents', e.g. loraplex-system) where each BaseModel's plan is also
    written, as the ConfigMap `<namespace>.<base>-plan` labelled loraplex.io/plan-mirror=true,
    for agents to find with one label selector (`loraplex-node-agent --plan-selector`) instead
    of a --plan-configmap per BaseModel; deleted with its BaseModel. Default:
    $LORAPLEX_PLAN_MIRROR_NAMESPACE, else none (no mirrors)."""


def mirror_namespace_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """LORAPLEX_PLAN_MIRROR_NAMESPACE, checked (ValueError) as the flag is; None when unset or empty."""
    value = (os.environ if env is None else env).get(MIRROR_NAMESPACE_ENV) or None
    if value is not None and not is_namespace(value):
        raise ValueError(f"{MIRROR_NAMESPACE_ENV} {value!r} is not a Kubernetes namespace name")
    return value


def parse_args(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> OperatorSettings:
    parser = argparse.ArgumentParser(prog="loraplex-operator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--namespace", action="append", default=[], dest="namespaces",
                        help="namespace to serve (repeatable, globs allowed); default: all")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--liveness", default=None, metavar="URL",
                        help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz; an empty host "
                             "(http://:8080/healthz) listens on every address of IPv4 and IPv6")
    parser.add_argument("--plan-mirror-namespace", default=None, metavar="NAMESPACE",
                        help="also write each BaseModel's plan into this namespace (the node agents'), "
                             "labelled loraplex.io/plan-mirror=true, for the agents to discover; "
                             f"default: ${MIRROR_NAMESPACE_ENV}, else none")
    args = parser.parse_args(argv)
    mirror = args.plan_mirror_namespace
    try:
        if mirror is None:
            mirror = mirror_namespace_from_env(env)
        elif not is_namespace(mirror):
            raise ValueError(f"--plan-mirror-namespace {mirror!r} is not a Kubernetes namespace name")
    except ValueError as exc:
        parser.error(str(exc))
    return OperatorSettings(tuple(args.namespaces), args.verbose, args.liveness, mirror)


def liveness_endpoints(settings: OperatorSettings) -> tuple[str | None, str | None]:
    """(kopf's liveness endpoint, ours): a URL with an empty host is ours (every address of
    both families: loraplex.operator.liveness); any other is kopf's."""
    if settings.liveness is None:
        return None, None
    parts = urllib.parse.urlsplit(settings.liveness)
    if parts.scheme == "http" and not parts.hostname:
        return None, settings.liveness
    return settings.liveness, None


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    kopf.configure(verbose=settings.verbose)
    import loraplex.operator  # noqa: F401  (registers the handlers)

    kopfs, ours = liveness_endpoints(settings)
    # One replica, no peering: the chart runs a single operator pod (Recreate strategy).
    kopf.run(
        standalone=True,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        liveness_endpoint=kopfs,
        # The startup handlers serve the liveness endpoint (handlers.serve_liveness) and make the
        # planner, with the mirror namespace (handlers.configure).
        memo=kopf.Memo(liveness=ours, plan_mirror_namespace=settings.plan_mirror_namespace),
    )


if __name__ == "__main__":
    main()
