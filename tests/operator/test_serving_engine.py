"""A BaseModel's server settings (serving.engine, extraArgs, env): the flags its Deployment
runs, the KV cache the packing math counts, and the specs refused because they would
contradict either."""

import pytest

from loraplex.operator.packing import kv_bytes, kv_cache_bytes, pack
from loraplex.operator.specs import BaseModelSpec, SpecError
from loraplex.operator.workloads import deployment, server_args

ARCH = {"hiddenSize": 4096, "intermediateSize": 14336, "numLayers": 32, "numAttentionHeads": 32,
        "numKeyValueHeads": 8, "vocabSize": 128256}


def body(serving=None, memory=None, architecture=ARCH):
    spec = {"source": "/models/llama-3-8b", "maxLoraRank": 16, "dtype": "bfloat16",
            "memory": memory or {"gpuMemory": "80G", "overhead": "4G"}}
    if architecture is not None:
        spec["architecture"] = architecture
    if serving is not None:
        spec["serving"] = serving
    return {"metadata": {"name": "llama-3-8b", "namespace": "ml"}, "spec": spec}


def flags(args: list[str], start: str) -> list[str]:
    return args[args.index(start):]


def test_engine_fields_become_flags_after_the_operators():
    base = BaseModelSpec.from_body(body({
        "engine": {"maxNumSeqs": 64, "maxModelLen": 4096, "maxPrefillTokens": 8192, "enableChunkedPrefill": True,
                   "evictionPolicy": "lfu-aged", "maxCpuLoras": 512, "maxConcurrentLoads": 2},
        "extraArgs": ["--log-level", "debug", "--no-decode-look-ahead"],
    }))
    args = server_args(base, 100)
    assert flags(args, "--max-num-seqs") == [
        "--max-num-seqs", "64", "--max-model-len", "4096", "--max-prefill-tokens", "8192",
        "--enable-chunked-prefill", "--max-cpu-loras", "512", "--max-concurrent-loads", "2",
        "--eviction-policy", "lfu-aged", "--log-level", "debug", "--no-decode-look-ahead"]
    off = BaseModelSpec.from_body(body({"engine": {"enableChunkedPrefill": False}}))
    assert flags(server_args(off, 1), "--max-num-seqs") == [
        "--max-num-seqs", "16", "--max-model-len", "2048", "--no-enable-chunked-prefill"]


def test_the_flags_parse_as_the_server_reads_them():
    """The operator's command line, given to the server's own parser, sets what the spec says."""
    settings_module = pytest.importorskip("loraplex.server.settings")
    base = BaseModelSpec.from_body(body({"engine": {"maxNumSeqs": 48, "maxModelLen": 3000, "evictionPolicy": "wtinylfu",
                                                    "enableChunkedPrefill": True, "maxCpuLoras": 7}}))
    args = [a.replace("$(NODE_IP)", "10.0.0.5") for a in server_args(base, 12)]
    settings = settings_module.ServerSettings.from_env_and_args(args)
    settings.validate()
    assert (settings.max_num_seqs, settings.max_model_len, settings.eviction_policy) == (48, 3000, "wtinylfu")
    assert (settings.enable_chunked_prefill, settings.max_cpu_loras, settings.max_loras) == (True, 7, 12)


def test_env_follows_the_operators_variables():
    base = BaseModelSpec.from_body(body({"env": [{"name": "LORAPLEX_DECODE_LOOK_AHEAD", "value": "false"},
                                                 {"name": "HF_HOME", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]}))
    env = deployment(base, 8)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e["name"] for e in env] == ["NODE_IP", "TRITON_CACHE_DIR", "LORAPLEX_DECODE_LOOK_AHEAD", "HF_HOME"]


def test_kv_cache_is_what_the_servers_allocate():
    # Llama-3-8B, bf16: 2 (K, V) * 32 layers * 8 kv heads * 128 * 2 bytes = 131072 bytes a token.
    default = BaseModelSpec.from_body(body())
    assert kv_bytes(default) == 131072 * 16 * 2048 == kv_cache_bytes(default.architecture, 16, 2048, 2)
    big = BaseModelSpec.from_body(body({"engine": {"maxNumSeqs": 64, "maxModelLen": 4096}}))
    assert kv_bytes(big) == 131072 * 64 * 4096  # 34.4 GB
    # The room shrinks by exactly the difference: 80 G - 16.06 G weights - KV - 4 G overhead.
    small, large = pack(default), pack(big)
    assert small.room_bytes - large.room_bytes == 131072 * (64 * 4096 - 16 * 2048)
    assert large.slots == large.room_bytes // large.slot_bytes < small.slots


def test_a_larger_reserve_wins_and_without_an_architecture_the_reserve_is_all():
    reserve = {"gpuMemory": "80G", "overhead": "4G", "kvCacheReserve": "30G"}
    assert kv_bytes(BaseModelSpec.from_body(body(memory=reserve))) == 30 * 10**9  # > 4.3 GB of 16 x 2048
    assert kv_bytes(BaseModelSpec.from_body(body({"engine": {"maxNumSeqs": 64, "maxModelLen": 4096}},
                                                 memory=reserve))) == 131072 * 64 * 4096
    bare = BaseModelSpec.from_body(body({"engine": {"maxNumSeqs": 64}}, architecture=None,
                                        memory={**reserve, "baseWeights": "16G", "adapterBytes": "40M"}))
    assert kv_bytes(bare) == 30 * 10**9


def test_engine_rows_that_leave_no_room_say_so():
    base = BaseModelSpec.from_body(body({"engine": {"maxNumSeqs": 256, "maxModelLen": 8192}}))
    packing = pack(base)  # 275 GB of KV on an 80 GB GPU
    assert (packing.slots, packing.reason) == (0, "NoRoom")
    assert "KV 274.9 GB" in packing.message


@pytest.mark.parametrize(("serving", "says"), [
    ({"extraArgs": ["--max-loras", "9"]}, "--max-loras"),
    ({"extraArgs": ["--max-num-seqs=64"]}, "--max-num-seqs"),
    ({"extraArgs": ["--max-num", "64"]}, "--max-num-seqs"),  # argparse takes a unique prefix
    ({"extraArgs": ["--node-agent=http://x"]}, "--node-agent-url"),
    ({"extraArgs": ["--log-level", "debug", "--served-model-name", "x"]}, "--served-model-name"),
    ({"extraArgs": ["--lora-modules", "a=/x"]}, "--lora-modules"),
    # vLLM's spelling of --max-prefill-tokens would override serving.engine.maxPrefillTokens.
    ({"extraArgs": ["--max-num-batched-tokens", "512"]}, "--max-num-batched-tokens"),
    # What the server's command line does not take: refused here, not in a crash loop of pods.
    ({"extraArgs": ["--log-levl", "debug"]}, "unrecognized arguments: --log-levl"),
    ({"extraArgs": ["--seed", "1.5"]}, "invalid int value"),
    ({"extraArgs": ["--log-level"]}, "expected one argument"),
    ({"extraArgs": ["--kv-offloading-size", "lots"]}, "invalid"),
    ({"extraArgs": ["/models/other"]}, "model folder"),
    ({"extraArgs": ["--help"]}, "--help"),
    ({"extraArgs": "--log-level debug"}, "list of strings"),
    ({"extraArgs": [3]}, "list of strings"),
    ({"env": [{"name": "NODE_IP", "value": "1.2.3.4"}]}, "NODE_IP"),
    ({"env": [{"value": "x"}]}, "each with a name"),
    ({"engine": {"evictionPolicy": "mru"}}, "evictionPolicy"),
    ({"engine": {"maxNumSeqs": 0}}, "maxNumSeqs"),
    ({"engine": {"maxModelLen": 1}}, "maxModelLen"),
    ({"engine": {"maxNumSeqs": True}}, "maxNumSeqs"),
    ({"engine": {"maxCpuLoras": 1.5}}, "maxCpuLoras"),
    ({"engine": {"enableChunkedPrefill": "yes"}}, "enableChunkedPrefill"),
])
def test_specs_that_would_contradict_the_operator_are_refused(serving, says):
    with pytest.raises(SpecError, match=says.replace("-", r"\-")):
        BaseModelSpec.from_body(body(serving))


@pytest.mark.parametrize("name", ["LORAPLEX_SERVED_MODEL_NAME", "LORAPLEX_LORA_MODULES", "LORAPLEX_DUMMY_WEIGHTS",
                                  "LORAPLEX_DEVICE", "LORAPLEX_EVICTION_POLICY", "LORAPLEX_MAX_LORAS"])
def test_the_environment_form_of_a_flag_the_operator_sets_is_refused(name):
    """The server reads LORAPLEX_<FIELD> for any flag its command line leaves out: refused in
    extraArgs, --served-model-name came in through env all the same, and the servers served
    the base under a name the BaseModel's status and the adapter-name check did not know
    (LORAPLEX_LORA_MODULES: adapters outside the plan; LORAPLEX_DUMMY_WEIGHTS: no checkpoint)."""
    with pytest.raises(SpecError, match=name):
        BaseModelSpec.from_body(body({"env": [{"name": name, "value": "x"}]}))


def test_every_variable_refused_is_one_the_server_reads():
    from loraplex.operator.specs import OPERATOR_ENV, OPERATOR_FLAGS
    from loraplex.server.settings import FLAG_ALIASES, ServerSettings

    read = {f"LORAPLEX_{f.name.upper()}" for f in ServerSettings.__dataclass_fields__.values()}
    aliases = {a for spellings in FLAG_ALIASES.values() for a in spellings}  # no variables of their own
    flags = {"LORAPLEX_" + f[2:].upper().replace("-", "_") for f in OPERATOR_FLAGS - aliases
             if not f.startswith("--no-")}
    assert flags <= read and flags <= OPERATOR_ENV
    assert OPERATOR_ENV - flags == {"NODE_IP", "TRITON_CACHE_DIR"}
