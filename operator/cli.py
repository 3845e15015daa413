"""`loraplex-operator`: run the kopf operator (the same as `kopf run -m loraplex.operator`).

    loraplex-operator                        # every namespace
    loraplex-operator --namespace ml -v      # one namespace, debug logs
"""

from __future__ import annotations

import argparse
import dataclasses
import urllib.parse

import kopf


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


def parse_args(argv: list[str] | None = None) -> OperatorSettings:
    parser = argparse.ArgumentParser(prog="loraplex-operator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--namespace", action="append", default=[], dest="namespaces",
                        help="namespace to serve (repeatable, globs allowed); default: all")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--liveness", default=None, metavar="URL",
                        help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz; an empty host "
                             "(http://:8080/healthz) listens on every address of IPv4 and IPv6")
    args = parser.parse_args(argv)
    return OperatorSettings(tuple(args.namespaces), args.verbose, args.liveness)


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
        memo=kopf.Memo(liveness=ours),  # the startup handler serves it (handlers.serve_liveness)
    )


if __name__ == "__main__":
    main()
