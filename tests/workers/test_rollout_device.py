"""Device-correctness of the multi-turn rollout path (issue 33: the calculator demo crashed on CUDA in
``torch.isin`` because the HF engine took its device from prompts the agent loop's server had built on
the host).

Without a GPU the device flow is checked on PyTorch's ``meta`` device, which CPU-only builds have:
tensors there carry shape, dtype and device but no data, so every function that must follow a device
is called with inputs on ``meta`` and its outputs must be there too (a tensor made without
``device=`` would land on the CPU). The ``gpu`` tests at the end run the real calculator conversation
on CUDA when a GPU exists.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfoundry.protocol import DataProto
from rlfoundry.utils.torch_functional import left_padded, rollout_layout
from rlfoundry.workers.rollout.agent_loop import AgentLoop, AgentLoopOutput
from rlfoundry.workers.rollout.agent_loop.server import GenerationServer, _Request
from rlfoundry.workers.rollout.hf_rollout import HFRollout, compute_device

META = torch.device("meta")


def test_left_padded_builds_on_the_engines_device():
    """Host by default (vLLM, SGLang take token lists), else the device asked for; same values."""
    host = left_padded([[5, 6], [7]], pad_id=0)
    assert host["input_ids"].tolist() == [[5, 6], [0, 7]]
    assert host["position_ids"].tolist() == [[0, 1], [0, 0]]
    moved = left_padded([[5, 6], [7]], pad_id=0, device=META)
    assert {t.device for t in moved.values()} == {META}
    assert {k: (t.shape, t.dtype) for k, t in moved.items()} == {k: (t.shape, t.dtype) for k, t in host.items()}


def test_rollout_layout_puts_every_tensor_on_the_prompts_device():
    """The agent loop's responses are Python lists; the layout joins them to prompts already on the
    worker's device (on CUDA the old code concatenated host responses with CUDA prompts)."""
    ids, mask = torch.tensor([[0, 3, 4]]), torch.tensor([[0, 1, 1]])
    host = rollout_layout(ids, mask, [[8, 9]], [[1, 0]], [[-0.5, 0.0]], width=4, pad_id=0)
    # hand-derived: responses padded to 4, attention 1 over real tokens, positions counted over them
    assert host["input_ids"].tolist() == [[0, 3, 4, 8, 9, 0, 0]]
    assert host["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0]]
    assert host["position_ids"].tolist() == [[0, 0, 1, 2, 3, 3, 3]]
    on_meta = rollout_layout(ids.to(META), mask.to(META), [[8, 9]], [[1, 0]], [[-0.5, 0.0]], width=4, pad_id=0)
    assert {k: t.device for k, t in on_meta.items()} == {k: META for k in host}
    assert {k: (t.shape, t.dtype) for k, t in on_meta.items()} == {k: (t.shape, t.dtype) for k, t in host.items()}


class _Engine:
    """A stand-in engine on ``device``: records the device of what it is given, answers on the host."""

    def __init__(self, device=None):
        if device is not None:
            self.device = device
        self.seen: list[torch.device] = []

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        self.seen += [t.device for t in prompts.batch.values()]
        rows, width = len(prompts), int(prompts.meta_info["response_length"])
        return DataProto.from_dict(tensors={
            "responses": torch.arange(rows * width).view(rows, width), "response_mask": torch.ones(rows, width),
            "rollout_log_probs": -torch.ones(rows, width)})


@pytest.mark.parametrize("device", [None, META])
def test_the_server_builds_the_engines_input_on_the_engines_device(device):
    """The engine's own ``device`` where it reports one (the HF engine), else the host; each request
    still gets its own row, cut to its own budget."""
    engine = _Engine(device)
    server = GenerationServer(engine, pad_id=0, meta={}, grace_s=0.0)
    out = server._run([_Request(0, [1, 2], 3, None), _Request(1, [4], 2, None)])
    assert set(engine.seen) == {device or torch.device("cpu")}
    assert [(g.token_ids, g.log_probs) for g in out] == [([0, 1, 2], [-1.0] * 3), ([3, 4], [-1.0] * 2)]


def test_the_agent_loops_output_stays_on_the_prompts_device():
    """``_assemble`` (prompt rows picked per trajectory, a prompt-less segment padded) keeps every tensor
    on the device the worker sent the prompts on."""
    loop = AgentLoop.__new__(AgentLoop)
    loop.pad_id, loop.response_length = 0, 4
    prompts = DataProto.from_dict(tensors={"input_ids": torch.zeros(2, 3, dtype=torch.long, device=META),
                                           "attention_mask": torch.ones(2, 3, dtype=torch.long, device=META)},
                                  non_tensors={"uid": np.array(["a", "b"], dtype=object)})
    outputs = [AgentLoopOutput([1], [5, 6], [1, 1], [-0.1, -0.2]), AgentLoopOutput([], [7], [0], [0.0]),
               AgentLoopOutput([2], [8], [1], [-0.3])]
    out = loop._assemble(prompts, n=1, outputs=outputs, sample=[0, 0, 1])
    assert {t.device for t in out.batch.values()} == {META}
    assert out.batch["input_ids"].shape == (3, 7)
    assert out.non_tensor_batch["uid"].tolist() == ["a", "a", "b"]


def test_the_same_rows_on_the_host_with_a_prompt_less_segment_padded():
    """The values ``_assemble`` gives (the meta test above sees only shapes): the segment without prompt
    ids has a padded, masked-out prompt; the others keep their sample's prompt."""
    loop = AgentLoop.__new__(AgentLoop)
    loop.pad_id, loop.response_length = 0, 2
    prompts = DataProto.from_dict(tensors={"input_ids": torch.tensor([[3, 4]]), "attention_mask": torch.tensor([[1, 1]])})
    out = loop._assemble(prompts, n=2, outputs=[AgentLoopOutput([3, 4], [5], [1], [-0.1]),
                                                AgentLoopOutput([], [6, 7], [0, 1], [0.0, -0.2])], sample=[0, 1])
    assert out.batch["input_ids"].tolist() == [[3, 4, 5, 0], [0, 0, 6, 7]]
    assert out.batch["attention_mask"].tolist() == [[1, 1, 1, 0], [0, 0, 1, 1]]
    assert prompts.batch["input_ids"].tolist() == [[3, 4]]  # the caller's batch is not written to


def test_the_hf_engine_takes_its_device_from_its_module_not_from_the_prompts(tiny_model_dir, monkeypatch):
    """Host prompts (as the agent loop's server or a judge builds them) go to the module's device before
    anything is made from them: the sampling generator, the EOS ids and the decode state are all made
    from the device ``_decode`` is handed. With the module on ``meta`` (no data: the common-padding scan,
    a host read, is stubbed) the call is stopped there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(META):
        module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    rollout = HFRollout(module, {"response_length": 3, "n": 1, "do_sample": False}, pad_token_id=0, eos_token_id=1)
    assert rollout.device == META == compute_device(module)
    seen = {}

    class Stop(Exception):
        pass

    def spy(input_ids, attention_mask, position_ids, *rest):  # rest: params, generator, pad, eos, pixels
        seen.update(ids=input_ids.device, mask=attention_mask.device, pos=position_ids.device)
        raise Stop

    monkeypatch.setattr("rlfoundry.workers.rollout.hf_rollout.common_left_padding", lambda mask: 0)
    rollout._next_generator = lambda device: seen.setdefault("generator", device)
    rollout._decode = spy
    prompts = DataProto.from_dict(tensors={"input_ids": torch.tensor([[2, 3]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)})
    with pytest.raises(Stop):
        rollout.generate_sequences(prompts)
    assert seen == {"generator": META, "ids": META, "mask": META, "pos": META}
    assert prompts.batch["input_ids"].device.type == "cpu"  # the caller's batch is not moved


def test_compute_device_reads_the_parameters():
    assert compute_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert compute_device(torch.nn.Linear(2, 2, device=META)) == META
    assert compute_device(torch.nn.ReLU()) == torch.device("cpu")  # no parameters: the host


# ---- the CUDA tier ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def taught_policy(tmp_path_factory):
    from tests.workers.test_agent_loop import tool_policy

    return tool_policy(tmp_path_factory.mktemp("tool-policy"))


@pytest.mark.gpu
@pytest.mark.parametrize("prompts_on", ["cuda", "cpu"])
def test_the_calculator_conversation_runs_on_cuda(taught_policy, prompts_on):
    """The issue's crash: the HF engine's module on CUDA under the agent loop with the calculator tool.
    Greedy decoding calls the tool, reads 56088 and answers, as on the CPU
    (``test_agent_loop.test_the_hf_engine_runs_a_real_tool_conversation``); the output is on the
    prompts' device and the engine's log-probs equal a recompute on CUDA."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfoundry.config.schema import MultiTurnConfig
    from rlfoundry.tools.registry import initialize_tools_from_config
    from tests.workers.test_agent_loop import CALL, FINAL, QUESTION, TOOLS, _prompts

    tokenizer = AutoTokenizer.from_pretrained(taught_policy)
    module = AutoModelForCausalLM.from_pretrained(taught_policy, dtype=torch.float32).to("cuda")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = HFRollout(module, {"response_length": 200, "n": 1, "val_kwargs": {"n": 1, "do_sample": False}},
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
    tools = {t.name: t for t in initialize_tools_from_config(TOOLS)}
    kwargs = {"tools": [t.get_openai_tool_schema().model_dump() for t in tools.values()]}
    loop = AgentLoop(engine, tokenizer, MultiTurnConfig(enable=True), tools, 200, chat_template_kwargs=kwargs)
    prompts = _prompts(tokenizer, kwargs, [QUESTION]).to(prompts_on)
    prompts.meta_info["validate"] = True  # greedy
    out = loop.generate_sequences(prompts)
    assert {t.device.type for t in out.batch.values()} == {prompts_on}
    length = int(out.batch["attention_mask"][0, 160:].sum())
    assert tokenizer.decode(out.batch["responses"][0, :length].tolist()) == (
        CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n" + FINAL + "<|im_end|>")
    mask = out.batch["response_mask"][0].bool().cuda()
    ids = out.batch["input_ids"].cuda()
    with torch.no_grad():
        logits = module(input_ids=ids, attention_mask=out.batch["attention_mask"].cuda(),
                        position_ids=out.batch["position_ids"].cuda()).logits[0, 159:-1]
    recomputed = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 160:, None]).squeeze(-1)
    torch.testing.assert_close(out.batch["rollout_log_probs"][0].cuda()[mask], recomputed[mask], atol=1e-4, rtol=0)
