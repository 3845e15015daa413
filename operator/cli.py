"""`loraplex-operator`: run the kopf operator (the same as `kopf run -m loraplex.operator`).

    loraplex-operator                        # every namespace
    loraplex-operator --namespace ml -v      # one namespace, debug logs
"""

from __future__ import annotations

import argparse
import dataclasses

import kopf


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    """Command-line settings of the operator; each flag maps onto one field."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to serve (globs allowed); empty: the whole cluster."""
    verbose: bool = False
    """Debug logging (kopf's and ours)."""
    liveness: str | None = None
    """kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz; None: off."""


def parse_args(argv: list[str] | None = None) -> OperatorSettings:
    parser = argparse.ArgumentParser(prog="loraplex-operator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--namespace", action="append", default=[], dest="namespaces",
                        help="namespace to serve (repeatable, globs allowed); default: all")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--liveness", default=None, metavar="URL",
                        help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    args = parser.parse_args(argv)
    return OperatorSettings(tuple(args.namespaces), args.verbose, args.liveness)


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    kopf.configure(verbose=settings.verbose)
    import loraplex.operator  # noqa: F401  (registers the handlers)

    # One replica, no peering: the chart runs a single operator pod (Recreate strategy).
    kopf.run(
        standalone=True,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        liveness_endpoint=settings.liveness,
    )


if __name__ == "__main__":
    main()
