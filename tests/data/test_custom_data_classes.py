"""verl's data.custom_cls (a user's data set class) and data.sampler (a user's sampler, e.g. a
curriculum): built with verl's constructor contracts, their state in the loader's checkpoint, and
start-up errors that name the key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from rlfoundry.data import DataError, build_dataloader, create_rl_dataset, create_rl_sampler
from tests.data.conftest import write_prompts

CLASSES = textwrap.dedent('''
    import torch
    from torch.utils.data import Sampler

    from rlfoundry.data.rl_dataset import RLHFDataset
    from rlfoundry.data.sampler import AbstractCurriculumSampler, AbstractSampler

    class EvenRowsDataset(torch.utils.data.Dataset):
        """Keeps the rows whose extra_info.index is even (a user's filter over the stock data set)."""
        def __init__(self, data_files, tokenizer, config, processor=None):
            self.inner = RLHFDataset(data_files, tokenizer, config, processor)
            self.keep = [i for i in range(len(self.inner)) if self.inner[i]["extra_info"]["index"] % 2 == 0]

        def __len__(self):
            return len(self.keep)

        def __getitem__(self, item):
            return self.inner[self.keep[item]]

    class Reversed(AbstractSampler):
        def __init__(self, data_source, data_config):
            self.n = len(data_source)
        def __iter__(self):
            return iter(range(self.n - 1, -1, -1))
        def __len__(self):
            return self.n

    class HardestFirst(AbstractCurriculumSampler):
        """Stateful: an epoch counter and a position, both in state_dict; order shifts each epoch."""
        def __init__(self, data_source, data_config):
            self.n, self.epoch, self.pos, self.updates = len(data_source), 0, 0, 0
        def __iter__(self):
            if self.pos >= self.n:  # the last epoch is done: the next one starts one further on
                self.pos, self.epoch = 0, self.epoch + 1
            order = [(i + self.epoch) % self.n for i in range(self.n)]
            while self.pos < self.n:
                self.pos += 1
                yield order[self.pos - 1]
        def __len__(self):
            return self.n
        def update(self, batch):
            self.updates += 1
        def state_dict(self):
            return {"epoch": self.epoch, "pos": self.pos, "updates": self.updates}
        def load_state_dict(self, state):
            self.epoch, self.pos, self.updates = state["epoch"], state["pos"], state["updates"]

    class NotADataset:
        pass
''')


@pytest.fixture()
def classes(tmp_path: Path) -> Path:
    path = tmp_path / "my_data.py"
    path.write_text(CLASSES)
    return path


@pytest.fixture()
def prompts(tmp_path: Path) -> Path:
    return write_prompts(tmp_path / "p.parquet", [f"q{i}" for i in range(8)])


def _indices(loader) -> list[list[int]]:
    return [[x["index"] for x in batch["extra_info"]] for batch in loader]


def test_custom_dataset_class_is_built_with_verls_contract(classes, prompts, tokenizer):
    ds = create_rl_dataset(str(prompts), {"custom_cls": {"path": str(classes), "name": "EvenRowsDataset"}}, tokenizer)
    assert type(ds).__name__ == "EvenRowsDataset"
    assert [ds[i]["extra_info"]["index"] for i in range(len(ds))] == [0, 2, 4, 6]


def test_custom_sampler_orders_the_loader(classes, prompts, tokenizer):
    data = {"sampler": {"class_path": str(classes), "class_name": "Reversed"}}
    ds = create_rl_dataset(str(prompts), data, tokenizer)
    loader = build_dataloader(ds, batch_size=4, sampler=create_rl_sampler(data, ds))
    assert _indices(loader) == [[7, 6, 5, 4], [3, 2, 1, 0]]


def test_a_stateful_sampler_resumes_exactly(classes, prompts, tokenizer):
    data = {"sampler": {"class_path": str(classes), "class_name": "HardestFirst"}}
    ds = create_rl_dataset(str(prompts), data, tokenizer)

    def loader():
        return build_dataloader(ds, batch_size=2, sampler=create_rl_sampler(data, ds))

    # uninterrupted: epoch 0 is 0..7, epoch 1 starts at 1 (the sampler's own state moves the order)
    straight = loader()
    want = _indices(straight) + _indices(straight)
    assert want[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]] and want[4] == [1, 2]
    # stop after 6 batches (mid-epoch 1), save, restore into a fresh loader and sampler
    first = loader()
    it, got = iter(first), []
    for _ in range(4):
        got.append([x["index"] for x in next(it)["extra_info"]])
    it = iter(first)  # epoch 1
    for _ in range(2):
        got.append([x["index"] for x in next(it)["extra_info"]])
    first.sampler.update(None)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    got += _indices(resumed)
    assert got == want
    assert resumed.sampler.updates == 1 and resumed.sampler.epoch == 1  # its state came back


def test_bad_classes_are_errors_naming_the_key(classes, prompts, tokenizer, tmp_path):
    def build(custom=None, sampler=None, **extra):
        data = {"custom_cls": custom or {}, "sampler": sampler or {}, **extra}
        ds = create_rl_dataset(str(prompts), data, tokenizer)
        return create_rl_sampler(data, ds)

    with pytest.raises(DataError, match=r"data.custom_cls.path=.*nope.py does not exist"):
        build({"path": str(tmp_path / "nope.py"), "name": "X"})
    with pytest.raises(DataError, match=r"has no 'Evens' \(data.custom_cls.name\); its classes are \[.*'EvenRowsDataset'"):
        build({"path": str(classes), "name": "Evens"})
    with pytest.raises(DataError, match=r"data.custom_cls.name=NotADataset .* must be a class deriving from torch.utils.data"):
        build({"path": str(classes), "name": "NotADataset"})
    with pytest.raises(DataError, match=r"data.sampler.class_path=.* is set but data.sampler.class_name is not"):
        build(sampler={"class_path": str(classes)})
    with pytest.raises(DataError, match=r"data.sampler.class_name=NotADataset .* must be a class deriving from torch.utils.data"):
        build(sampler={"class_path": str(classes), "class_name": "NotADataset"})
    with pytest.raises(DataError, match=r"needs data.dataloader_num_workers=0"):
        build(sampler={"class_path": str(classes), "class_name": "Reversed"}, dataloader_num_workers=2)


def test_the_trainer_loaders_use_the_configured_classes(classes, prompts, tokenizer):
    from rlfoundry.trainer.config import load_config
    from rlfoundry.trainer.main_ppo import build_dataloaders

    cfg = load_config([f"data.custom_cls.path={classes}", "data.custom_cls.name=EvenRowsDataset",
                       f"data.sampler.class_path={classes}", "data.sampler.class_name=Reversed",
                       "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"])
    train, val = build_dataloaders(cfg, tokenizer, str(prompts), str(prompts))
    assert len(train) == 0  # 4 even rows do not fill one batch of 8 (drop_last) ...
    assert [x["extra_info"]["index"] for x in train.dataset] == [0, 2, 4, 6]  # ... the even rows only
    assert list(train.sampler) == [3, 2, 1, 0]  # in the sampler's (reversed) order
    assert type(val.dataset).__name__ == "EvenRowsDataset"


@pytest.mark.slow
def test_a_curriculum_sampler_learns_from_each_trained_batch(classes, tiny_model_dir, tmp_path):
    """A run with the curriculum sampler: update() gets every step's trained batch (with its scores),
    and the checkpoint holds the sampler's state."""
    import torch

    from tests.trainer import _e2e as E

    run = E.train(E.tiny_overrides(tiny_model_dir, tmp_path / "run", f"data.sampler.class_path={classes}",
                                   "data.sampler.class_name=HardestFirst", "trainer.save_freq=2"), keep_trainer=True)
    sampler = run.trainer.train_dataloader.sampler
    assert type(sampler).__name__ == "HardestFirst" and sampler.updates == 2  # two steps, two updates
    # HardestFirst's epoch 0 is file order: the steps trained on prompts 0-1, then 2-3
    assert [sorted({x["index"] for x in b["extra_info"]}) for b in run.batches] == [[0, 1], [2, 3]]
    state = torch.load(tmp_path / "run" / "global_step_2" / "data.pt", weights_only=False)
    assert "'updates': 2" in str(state["dataloader"]) and "'pos': 4" in str(state["dataloader"])


def test_the_trainer_loaders_draw_train_and_validation_subsets(prompts, tokenizer):
    """verl's data.train_max_samples / val_max_samples reach the train and validation sets separately."""
    from rlfoundry.trainer.config import load_config
    from rlfoundry.trainer.main_ppo import build_dataloaders

    cfg = load_config(["data.train_max_samples=5", "data.val_max_samples=3", "data.shuffle=false",
                       "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    train, val = build_dataloaders(cfg, tokenizer, str(prompts), str(prompts))
    assert (len(train.dataset), len(val.dataset)) == (5, 3)
    assert [x["extra_info"]["index"] for x in val.dataset] == [0, 1, 2]  # unshuffled: the first rows
