"""SPO in the trainer (``trainer.spo.enable``, verl's ``recipe/spo``): the per-prompt tracker and its source.

``SPOSource`` takes the loader's batch (``data.gen_batch_size`` prompts, as verl's loader), draws
``data.train_batch_size`` of them by priority (``algos/spo.sampling_weights``), generates and scores
them, and writes each row's tracker mean into ``reward_baselines``, which the ``spo`` estimator reads
(the trainer picks it when SPO is on, whatever ``algorithm.adv_estimator`` says, as verl's recipe
does). After the actor's update the tracker learns each row's reward, forgetting by ``rho``; with
``rho.type=kl`` the policy's move is measured on the prompt's previous response, whose log-probs
under the then-updated policy the tracker keeps. All of it is in the trainer's checkpoint, so a
resumed run draws, baselines and forgets as the uninterrupted one.

A prompt is keyed by the text of its first message, stripped (the keys of verl's offline values file).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfoundry.algos import spo
from rlfoundry.protocol import DataProto
from rlfoundry.trainer.metric_utils import marked_timer
from rlfoundry.trainer.ppo.sources import SyncSource
from rlfoundry.utils.tokenizer import pad_id

__all__ = ["SPOSource", "SPOTracker", "prompt_keys"]

_ROW_KEYS = ("input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask")


def prompt_keys(batch: Any) -> list[str]:
    """Each row's prompt key: its first message's content, stripped (``raw_prompt``, a batch dict or a
    DataProto's non-tensor column)."""
    raw = batch["raw_prompt"] if isinstance(batch, dict) else batch.non_tensor_batch["raw_prompt"]
    return [str(messages[0]["content"]).strip() for messages in raw]


def stack_rows(rows: list[dict[str, torch.Tensor]], pad_id: int) -> DataProto:
    """Single rows of different widths as one batch: the prompt side left-padded, the response side
    right-padded to the widest (pad columns are masked, so log-probs do not change)."""
    tp = max(r["prompts"].shape[-1] for r in rows)
    tr = max(r["responses"].shape[-1] for r in rows)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in _ROW_KEYS if k in rows[0]}
    pads = {"input_ids": pad_id, "prompts": pad_id, "responses": pad_id}
    for row in rows:
        left, right = tp - row["prompts"].shape[-1], tr - row["responses"].shape[-1]
        for key in out:
            before = left if key in ("input_ids", "attention_mask", "position_ids", "prompts") else 0
            after = 0 if key == "prompts" else right
            out[key].append(torch.nn.functional.pad(row[key], (before, after), value=pads.get(key, 0)))
    return DataProto.from_dict(tensors={k: torch.cat(v) for k, v in out.items()})


class SPOTracker:
    """Per-prompt Beta(alpha, beta) success estimates, visit counts, and (``rho.type=kl``) each prompt's
    last response with its log-probs under the policy updated after it."""

    def __init__(self, cfg: Any, seed: int = 0):
        self.cfg = cfg
        self.alpha: dict[str, float] = {}
        self.beta: dict[str, float] = {}
        self.visits: dict[str, int] = {}
        self.rows: dict[str, dict[str, torch.Tensor]] = {}
        self.log_probs: dict[str, torch.Tensor] = {}
        # a table restricts the draw to its prompts (verl's); without one every prompt starts at Beta(0.5, 0.5)
        self.closed = cfg.offline_values is not None
        if self.closed:
            self._load_offline(Path(str(cfg.offline_values)).expanduser(), random.Random(seed))

    def _load_offline(self, path: Path, rng: random.Random) -> None:
        table = json.loads(path.read_text())
        for key, scores in table.items():
            self.alpha[key], self.beta[key] = spo.offline_prior(scores, int(self.cfg.offline_N),
                                                                float(self.cfg.rho.clip_lower), rng)

    def prior(self, key: str) -> tuple[float, float]:
        return self.alpha.get(key, 0.5), self.beta.get(key, 0.5)

    def weights(self, keys: list[str]) -> np.ndarray:
        """Sampling weights of ``keys``; 0 for a prompt the offline table does not have (verl's)."""
        ab = np.array([self.prior(k) for k in keys], dtype=np.float64).reshape(-1, 2)
        w = spo.sampling_weights(ab[:, 0], ab[:, 1])
        if self.closed:
            w = np.where([k in self.alpha for k in keys], w, 0.0)
        return w

    def baselines(self, keys: list[str]) -> torch.Tensor:
        """p_hat = alpha / (alpha + beta) per row (B,)."""
        ab = torch.tensor([self.prior(k) for k in keys], dtype=torch.float32).reshape(-1, 2)
        return ab[:, 0] / ab.sum(-1)

    def update(self, keys: list[str], rewards: torch.Tensor, rho: torch.Tensor) -> None:
        """The discounted Beta update of every row (a prompt drawn twice: its last row's values stay, verl's)."""
        ab = torch.tensor([self.prior(k) for k in keys], dtype=torch.float32).reshape(-1, 2)
        alpha, beta = spo.update_beta(ab[:, 0], ab[:, 1], rho.float(), rewards.float())
        for i, key in enumerate(keys):
            self.alpha[key], self.beta[key] = float(alpha[i]), float(beta[i])
            self.visits[key] = self.visits.get(key, 0) + 1

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": dict(self.alpha), "beta": dict(self.beta), "visits": dict(self.visits),
                "rows": {k: dict(v) for k, v in self.rows.items()}, "log_probs": dict(self.log_probs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha, self.beta = dict(state["alpha"]), dict(state["beta"])
        self.visits = {k: int(v) for k, v in state["visits"].items()}
        self.rows = {k: dict(v) for k, v in state["rows"].items()}
        self.log_probs = dict(state["log_probs"])


class SPOSource(SyncSource):
    """Prioritised prompts, tracker baselines before the advantages, the tracker update after the actor's."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self.cfg = trainer.config.trainer.spo
        self.tracker = SPOTracker(self.cfg, seed=int(trainer.config.trainer.seed))
        self._batch: DataProto | None = None

    def next_batch(self, timing: dict) -> tuple[DataProto, dict[str, float]]:
        trainer = self.trainer
        batch_dict = self._draw(next(self.loader))
        batch = trainer.generate(batch_dict, timing)
        batch, metrics = trainer.reward(batch, timing)  # synchronous: the baselines sit beside the scores
        keys = prompt_keys(batch)
        batch.batch["reward_baselines"] = self.tracker.baselines(keys)
        self._batch = batch
        ab = torch.tensor([self.tracker.prior(k) for k in keys]).reshape(-1, 2)
        p_hat, r = batch.batch["reward_baselines"], batch.batch["token_level_scores"].sum(-1).float()
        adv = spo.spo_advantages(r, p_hat)  # what the `spo` estimator will give each row, for verl's metrics
        quantiles = torch.quantile(adv, torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9]))
        return batch, metrics | {"spo/alpha": float(ab[:, 0].mean()), "spo/beta": float(ab[:, 1].mean()),
                                 "spo/Neff": float(ab.sum(-1).mean()), "spo/p_hats": float(p_hat.mean()),
                                 "spo/adv_before_norm": float((r - p_hat).mean())} | {
            f"spo/adv_after_norm/p{q}": float(v) for q, v in zip((10, 30, 50, 70, 90), quantiles)}

    def _draw(self, batch_dict: dict) -> dict:
        """``data.train_batch_size`` of the loader's prompts, by priority; drawn from a generator seeded by
        (trainer.seed, step), so a resumed run draws alike."""
        keys = prompt_keys(batch_dict)
        step = self.trainer.state.global_steps
        rng = np.random.default_rng([int(self.trainer.config.trainer.seed), step])
        picked = spo.draw_prompts(self.tracker.weights(keys), int(self.trainer.config.data.train_batch_size), rng)
        out = {}
        for key, value in batch_dict.items():
            out[key] = value[torch.as_tensor(picked)] if torch.is_tensor(value) else (
                value[picked] if isinstance(value, np.ndarray) else [value[i] for i in picked])
        return out

    def after_update(self, timing: dict) -> dict[str, float]:
        """The tracker learns the step's rewards, forgetting by rho (under the just-updated policy)."""
        batch, self._batch = self._batch, None
        keys = prompt_keys(batch)
        rewards = batch.batch["token_level_scores"].sum(-1).float()
        if self.cfg.rho.type == "constant":
            rho = torch.full((len(keys),), float(self.cfg.rho.value))
            metrics = {"spo/D": 0.0, "spo/rho": float(self.cfg.rho.value)}
        else:
            with marked_timer("spo_rho", timing):
                rho, metrics = self._kl_rho(batch, keys)
        self.tracker.update(keys, rewards, rho)
        visits = np.array([self.tracker.visits[k] for k in keys])
        return metrics | {"spo/reward": float(rewards.mean()),
                          "spo/cur_sampled_number/min": float(visits.min()),
                          "spo/cur_sampled_number/mean": float(visits.mean()),
                          "spo/cur_sampled_number/max": float(visits.max())}

    def _kl_rho(self, batch: DataProto, keys: list[str]) -> tuple[torch.Tensor, dict[str, float]]:
        """rho per row from the policy's move on the prompt's previous response (a first visit: this one,
        D = 0); then this step's rows and their log-probs become the prompts' previous responses. Both
        log-prob passes go in one call."""
        rows = [{k: batch.batch[k][i:i + 1].clone() for k in _ROW_KEYS if k in batch.batch.keys()}
                for i in range(len(batch))]
        seen = [k in self.tracker.rows for k in keys]
        past = [self.tracker.rows[k] if s else rows[i] for i, (k, s) in enumerate(zip(keys, seen))]
        both = stack_rows(past + rows, pad_id(self.trainer.tokenizer))
        both.meta_info = {k: v for k, v in batch.meta_info.items() if k == "temperature"}
        log_probs = self.trainer.actor_rollout_wg.compute_log_prob(both).batch["old_log_probs"]
        n, width = len(keys), log_probs.shape[-1]
        now_past, now_new = log_probs[:n], log_probs[n:]
        then = torch.stack([self._padded(self.tracker.log_probs[k], width) if s else now_past[i]
                            for i, (k, s) in enumerate(zip(keys, seen))])
        mask = both.batch["attention_mask"][:n, -width:]  # verl's compute_response_mask (tool tokens count)
        rho, d = spo.kl_rho(then, now_past, mask, float(self.cfg.rho.clip_lower))
        for i, key in enumerate(keys):
            self.tracker.rows[key] = rows[i]
            self.tracker.log_probs[key] = now_new[i:i + 1, :rows[i]["responses"].shape[-1]].clone()
        unclipped = torch.pow(2.0, -d / spo.D_HALF)  # verl logs rho before and after the clip
        return rho, {"spo/D": float(d.mean()), "spo/first_sampled_ratio": 1.0 - float(np.mean(seen)),
                     "spo/rho": float(unclipped.mean()), "spo/rho_clipped": float(rho.mean()),
                     "spo/rho_clip_ratio": float((rho != unclipped).float().mean())}

    @staticmethod
    def _padded(log_probs: torch.Tensor, width: int) -> torch.Tensor:
        """A stored (1, Tr) row right-padded with zeros to ``width`` (masked columns)."""
        return torch.nn.functional.pad(log_probs[0].float(), (0, width - log_probs.shape[-1]))

    def checkpoint_state(self) -> dict[str, Any]:
        return {"spo_tracker": self.tracker.state_dict()}

    def on_resume(self, state: dict[str, Any]) -> None:
        if "spo_tracker" in state:
            self.tracker.load_state_dict(state["spo_tracker"])
