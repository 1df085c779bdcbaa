"""The `kvtier` command: offline rendering, CRD generation, and the operator process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from kvtier_operator.context import (
    DEFAULT_OFFLOAD_IMAGE,
    DEFAULT_OPERATOR_IMAGE,
    RenderContext,
)
from kvtier_operator.loading import load_documents, split_tpcs
from kvtier_operator.render.objects import render_objects
from kvtier_operator.render.pod import inject_workload
from kvtier_operator.validation import InvalidResource, deprecations, parse_tpc
from kvtier_operator.validation.host_paths import host_path_refusal, parse_allowed
from kvtier_operator.validation.object_endpoints import (
    object_endpoint_refusal,
    parse_allowed_endpoints,
)
from kvtier_operator.yamlio import dump_all

EXIT_INVALID = 2
EXIT_CONFLICT = 3


def _read(path: str) -> str:
    return sys.stdin.read() if path == "-" else Path(path).read_text()


def _objects(path: str) -> list[dict[str, Any]] | None:
    """The YAML documents of `path`, or None after saying on stderr why they are unusable."""
    try:
        docs = load_documents(_read(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as err:
        # ValueError: e.g. an integer of more than 4300 digits
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"error: {path}: cannot read it as YAML: {reason[:300]}", file=sys.stderr)
        return None
    for number, doc in enumerate(docs, 1):
        if not isinstance(doc, dict) or not isinstance(doc.get("metadata", {}), dict | None):
            print(f"error: {path}: document {number} is not a Kubernetes object (a mapping "
                  "whose metadata is a mapping)", file=sys.stderr)
            return None
    return docs


def cmd_render(args: argparse.Namespace) -> int:
    try:  # the operator's own reading of the list (KVTIER_ALLOWED_HOST_PATHS)
        allowed = parse_allowed(",".join(args.allow_host_path or ()))
        endpoints = parse_allowed_endpoints(",".join(args.allow_object_endpoint or ()))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID
    ctx = RenderContext(offload_image=args.offload_image, evictor_image=args.evictor_image,
                        allowed_host_paths=allowed, allowed_object_endpoints=endpoints)
    docs = _objects(args.file)
    if docs is None:
        return EXIT_INVALID
    tpc_docs, _ = split_tpcs(docs)
    if not tpc_docs:
        print(f"error: {args.file} holds no TieredPrefixCache", file=sys.stderr)
        return EXIT_INVALID
    try:
        tpcs = [parse_tpc(d) for d in tpc_docs]
    except InvalidResource as err:
        print(f"error: TieredPrefixCache {err.name} is invalid:", file=sys.stderr)
        for message in err.messages:
            print(f"  {message}", file=sys.stderr)
        return EXIT_INVALID
    refused = [(t.name, why) for t in tpcs
               if (why := host_path_refusal(t.spec, ctx.allowed_host_paths)
                   or object_endpoint_refusal(t.spec, ctx.allowed_object_endpoints))]
    for name, why in refused:
        print(f"error: TieredPrefixCache {name} is invalid:\n  {why} (kvtier render: "
              "--allow-host-path, --allow-object-endpoint)", file=sys.stderr)
    if refused:
        return EXIT_INVALID
    out: list[dict[str, Any]] = []
    for tpc in tpcs:
        for warning in deprecations(tpc):
            print(f"warning: TieredPrefixCache {tpc.name}: {warning}", file=sys.stderr)
        out += render_objects(tpc, ctx)
    status = 0
    if args.pod:
        workloads = _objects(args.pod)
        if workloads is None:
            return EXIT_INVALID
        for obj in workloads:
            ns = (obj.get("metadata") or {}).get("namespace")
            mutated = obj
            for tpc in tpcs:
                if ns is not None and ns != tpc.namespace:
                    continue
                try:
                    mutated, conflicts = inject_workload(tpc, mutated, ctx)
                except ValueError as err:
                    print(f"error: {err}", file=sys.stderr)
                    return EXIT_INVALID
                for conflict in conflicts:
                    name = (obj.get("metadata") or {}).get("name", "?")
                    print(f"conflict: {obj.get('kind')} {name}: {conflict}", file=sys.stderr)
                    status = EXIT_CONFLICT
            out.append(mutated)
    sys.stdout.write(dump_all(out))
    return status


def cmd_crd(args: argparse.Namespace) -> int:
    from kvtier_operator.crd import crd

    text = ("# Generated from kvtier_operator.api.v1alpha1 by `make crds`; do not edit.\n"
            + dump_all([crd()]))
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_operator(args: argparse.Namespace) -> int:
    from kvtier_operator.app import run

    run(args.metrics_port, args.liveness, args.namespace or [], args.log_format == "json",
        args.webhook_port, args.webhook_cert_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    render = sub.add_parser(
        "render",
        help="print every object and patch the operator would apply, offline",
    )
    render.add_argument("-f", "--file", required=True, help="TieredPrefixCache YAML (- = stdin)")
    render.add_argument("--pod", help="a Pod or workload (Deployment, StatefulSet, "
                        "LeaderWorkerSet...) to print as the webhook would mutate it")
    render.add_argument("--offload-image", "--sidecar-image", dest="offload_image",
                        default=DEFAULT_OFFLOAD_IMAGE,
                        help="the offload backend's image for the init container "
                        "(--sidecar-image: its name before 0.2, deprecated)")
    render.add_argument("--evictor-image", default=DEFAULT_OPERATOR_IMAGE)
    render.add_argument("--allow-host-path", action="append", metavar="DIR",
                        help="a node directory local disks may use (the Helm value "
                        "localDisk.allowedHostPaths; repeatable; none by default)")
    render.add_argument("--allow-object-endpoint", action="append", metavar="URL",
                        help="an S3 endpoint object stores may name (the Helm value "
                        "objectStore.allowedEndpoints; repeatable; none by default)")
    render.set_defaults(func=cmd_render)

    crd_cmd = sub.add_parser("crd", help="print (or write) the generated CRD")
    crd_cmd.add_argument("-o", "--output", help="write to this file")
    crd_cmd.set_defaults(func=cmd_crd)

    op = sub.add_parser("operator", help="run the operator (kopf, standalone)")
    op.add_argument("--metrics-port", type=int, default=8080, help="0 disables metrics")
    op.add_argument("--liveness", default="http://0.0.0.0:8081/healthz")
    op.add_argument("--namespace", action="append", help="watch only these (repeatable)")
    op.add_argument("--log-format", choices=["json", "text"], default="json")
    op.add_argument("--webhook-port", type=int, default=9443, help="0 disables the webhooks")
    op.add_argument("--webhook-cert-dir", default="/etc/kvtier/webhook",
                    help="holds tls.crt and tls.key (a mounted Secret; reloaded on rotation)")
    op.set_defaults(func=cmd_operator)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
