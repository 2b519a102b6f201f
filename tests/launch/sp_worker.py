"""Run by tests/launch/test_sequence_parallel.py under `torchrun --nproc_per_node 2` (gloo, CPU): TRL's real DPO
loss on one real batch, first without sequence parallelism (each rank alone, the whole batch), then with sp_size=2
(each rank half of every sequence). Writes, per rank, the loss, TRL's logged metrics and every parameter's gradient
as the data-parallel engines would apply it (summed over ranks / world size) to $SP_OUT/rank<r>.pt."""

import os

import torch
import torch.distributed as dist

from longdpo.config import ModelArgs  # noqa: E402
from longdpo.levers.sequence_parallel import SequenceParallel  # noqa: E402
from longdpo.model.build import build_byte_tokenizer, build_model  # noqa: E402
from longdpo.patches import distributed_on_cpu  # noqa: E402
from longdpo.train import exit_now  # noqa: E402

TINY = ModelArgs(
    architecture=f"recipes/architectures/tiny_{os.environ.get('SP_FAMILY', 'mistral')}.json",
    tokenizer="byte",
    dtype="float32",
)


def loss_metrics_grads(trainer, inputs):
    trainer._metrics["train"].clear()
    trainer._total_train_tokens = 0
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {}
    for name, p in trainer.model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # what DeepSpeed/DDP do: average over all ranks
        grads[name] = g / dist.get_world_size()
    return loss.detach(), {k: v[-1] for k, v in trainer._metrics["train"].items()}, grads


def main():
    distributed_on_cpu()  # as train_dpo does on CPU
    dist.init_process_group("gloo")
    from trl import DPOConfig, DPOTrainer

    from longdpo.data.loading import load_preferences

    pairs = int(os.environ.get("SP_PAIRS", "3"))  # 3 pairs = 6 sequences: below the micro-batch of 8 (padded)
    args = DPOConfig(
        output_dir="/tmp/unused",
        report_to="none",
        bf16=False,
        per_device_train_batch_size=pairs,
        max_length=int(os.environ.get("SP_MAX_LENGTH", "77")),
        activation_checkpointing=True,
        use_cpu=True,
    )
    data = load_preferences(["recipes/data/arithmetic_preferences.jsonl"]).select(range(pairs))
    trainer = DPOTrainer(
        model=build_model(TINY),
        ref_model=build_model(ModelArgs(**{**TINY.__dict__, "init_seed": 1})),
        args=args,
        train_dataset=data,
        processing_class=build_byte_tokenizer(),
    )
    trainer.model.train()
    trainer._tp_size = 2  # both runs give both ranks the same batch: count its tokens once (train_dpo sets this)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(pairs)])
    if batch["input_ids"].shape[1] % 2 == 0:  # an odd length: sp_size 2 must pad it
        batch = {
            k: v[:, :-1] if k in ("input_ids", "attention_mask", "completion_mask") else v for k, v in batch.items()
        }
    inputs = trainer._prepare_inputs(batch)
    plain = loss_metrics_grads(trainer, inputs)

    sp = SequenceParallel(2, 8, trainer.model)  # micro-batch 8 sequences = 4 pairs
    sp.wrap(trainer.model)
    sp.wrap(trainer.ref_model)
    sharded = loss_metrics_grads(trainer, inputs)
    torch.save(
        {
            "seq_len": inputs["input_ids"].shape[1],
            "plain": plain,
            "sp": sharded,
            "dp": (sp.dp_rank, sp.dp_size),
            "sp_rank": sp.rank,
        },
        os.path.join(os.environ["SP_OUT"], f"rank{dist.get_rank()}.pt"),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as the entrypoint ends: the interpreter's teardown of gloo's threads now and then aborts (SIGABRT)
