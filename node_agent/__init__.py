"""loraplex.node_agent: stages LoRA adapters on a node's local disk and warms its servers.

One process per node (a DaemonSet), no torch. The adapter bytes path, one module per stage:

    sources.py   fetch an adapter directory by URI: absolute path, file://, http(s)://
    store.py     the local disk cache: verify sha256 + safetensors header, fsync, atomic
                 rename and symlink swap; byte budget (LRU, pinned last); N downloads at
                 once; one download per adapter version however many ask
    warmer.py    follow the operator's plan (mounted file or, through kube.py, the ConfigMap):
                 pins, pinned first then open warm-up windows, removals, retries; warm each
                 server pod of the base on this node when it turns ready; session starts
    kube.py      server pods on this node, the plan ConfigMap, status.nodes.<node> reports
    app.py       HTTP API: /v1/stage, /v1/sessions, /v1/adapters, /healthz, /metrics
    cli.py       `loraplex-node-agent`: settings dataclass, one flag per field

Contract with the servers on the node: they mount the cache directory read-only and find
adapter `<name>` at `<cache>/<name>/` (adapter_config.json, adapter_model.safetensors); the
agent asks them to load and pin through `POST /v1/adapters/<name>/prefetch?wait=false` and
`POST /v1/adapters/<name>/pin`, and takes back a pin the plan no longer makes through
`POST /v1/adapters/<name>/unpin`.
"""
