"""`make demo`: what kvtier does for each example TieredPrefixCache, offline.

For every example CR it validates, renders the objects the operator creates, and shows
the sample vLLM Deployment as the webhook mutates it (a diff against the original).
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

from kvtier_operator.loading import load_documents, parse_tpc, split_tpcs
from kvtier_operator.render import sizing
from kvtier_operator.render.connector import kv_transfer_json
from kvtier_operator.render.context import RenderContext
from kvtier_operator.render.objects import render_objects
from kvtier_operator.render.pod import inject_workload
from kvtier_operator.yamlio import dump, dump_all

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SAMPLE = "vllm-deployment.yaml"


def _section(title: str) -> None:
    print(f"\n{'=' * 78}\n{title}\n{'=' * 78}")


def main(examples: Path = EXAMPLES) -> int:
    ctx = RenderContext()
    sample = load_documents((examples / SAMPLE).read_text())[0]
    rendered = 0
    for path in sorted(examples.glob("*.yaml")):
        tpc_docs, _ = split_tpcs(load_documents(path.read_text()))
        for doc in tpc_docs:
            tpc = parse_tpc(doc)
            spec = tpc.spec
            _section(f"{path.name}: TieredPrefixCache {tpc.namespace}/{tpc.name}")
            backend = spec.storage_backend or ("lmcache-disk" if spec.storage else "none")
            print(f"connector {spec.connector}, CPU tier {spec.cpu.size}, "
                  f"shared tier: {backend}")
            print(f"KV bytes/token {spec.model.bytes_per_token:,}; router "
                  f"lruCapacityPerServer {sizing.router_lru_capacity(spec):,}")
            print(f"--kv-transfer-config {kv_transfer_json(tpc)}")
            objs = render_objects(tpc, ctx)
            kinds = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in objs) or "none"
            print(f"objects the operator applies: {kinds}")
            mutated, conflicts = inject_workload(tpc, sample, ctx)
            for conflict in conflicts:
                print(f"conflict: {conflict}")
            diff = difflib.unified_diff(
                dump(sample).splitlines(), dump(mutated).splitlines(),
                f"{SAMPLE} (as written)", f"{SAMPLE} (as injected)", lineterm="", n=1,
            )
            print("\n".join(diff))
            if path.name == "native-kvtier.yaml":
                print("\n--- everything `kvtier render` prints for this example ---")
                print(dump_all(objs))
            rendered += 1
    _section(f"rendered {rendered} TieredPrefixCache examples; all valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
