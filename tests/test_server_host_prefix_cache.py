"""The prefix cache's host tier through Triton: swap_space set in config.pbtxt; a shared prompt
evicted from a small device cache by four others is found in host memory when it comes back
(the same text), and the host-tier counters move on Triton's metrics endpoint."""
import random

from triton_server import StreamCollector, grpc_inputs, start_server, wait_until, write_model_repository

LABELS = {"model": "llm", "version": "1"}


def test_an_evicted_prefix_comes_back_from_host_memory(tiny_model, tmp_path):
    # 12 device blocks of 16 tokens: each 70-token prompt and its 8 tokens take 5 of them.
    args = {"model": tiny_model, "dtype": "float32", "num_kv_blocks": "12", "block_size": "16",
            "max_num_seqs": "4", "max_model_len": "256", "swap_space": "0.001"}
    server = start_server(write_model_repository(str(tmp_path / "repo"), args), str(tmp_path / "tritonserver.log"))
    rng = random.Random(7)
    shared, *others = [[rng.randrange(3, 500) for _ in range(70)] for _ in range(5)]
    sampling = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    stream = StreamCollector(server.grpc_url)
    try:
        texts = []
        for i, ids in enumerate([shared, *others, shared]):
            stream.send(f"r{i}", grpc_inputs(input_ids=ids, sampling=sampling, stream=True))
            texts.append(stream.wait(f"r{i}").text)
        assert stream.errors.empty()
        assert texts[-1] == texts[0] and texts[0]
        # The shared prompt's 4 full blocks (a hit never covers the last token) came back.
        assert wait_until(lambda: server.metric("vllm:external_prefix_cache_hits_total", **LABELS) == 64, 10)
        assert server.metric("tritium:kv_blocks_reloaded_total", **LABELS) == 4
        assert server.metric("tritium:kv_blocks_offloaded_total", **LABELS) >= 4
        assert server.metric("vllm:prefix_cache_hits_total", **LABELS) == 64
        # every prompt's tokens but the device's hits (none here) were looked up on the host
        assert server.metric("vllm:external_prefix_cache_queries_total", **LABELS) \
            == server.metric("vllm:prefix_cache_queries_total", **LABELS)
        assert server.metric("vllm:cpu_cache_usage_perc", **LABELS) == 0
    finally:
        stream.close()
        server.stop_in_background()
