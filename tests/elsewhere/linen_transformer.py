"""A BERT-style masked-LM encoder in Flax linen, trained the way the Hugging Face
`run_mlm_flax.py` script trains one.

Post-LN encoder layers (`nn.MultiHeadDotProductAttention`, `nn.Dense`, `nn.LayerNorm`,
`nn.Dropout`), word + position + token-type embeddings, a padding attention mask from
`nn.make_attention_mask`, and an MLM head (dense, GELU, LayerNorm, then the tied word
embedding's `.attend` plus an output bias).  Dropout is on: the step takes a dropout
PRNG key, splits it and hands the new one back.  The loss is HF's: one-hot labels over
the vocabulary, masked to the positions that carry a label (labels are -100 elsewhere).
Optimizer: ``optax.chain(clip_by_global_norm(1.0), adamw(...))`` with a linear
warmup/decay schedule and no weight decay on biases and LayerNorm scales.

The step is ``train_step(params, opt_state, dropout_rng, batch) ->
(params, opt_state, new_dropout_rng, loss)`` with ``batch`` a dict of ``input_ids``,
``attention_mask``, ``token_type_ids`` and ``labels``, all int32 ``[batch, seq]``.

Sizes: ``tiny`` (vocab 512, width 64, 4 heads, 2 layers, batch 16 x 32) and ``paper``
(BERT-base: vocab 30522, width 768, 12 heads, 12 layers, MLP 3072, 512 positions,
batch 2048 x 128; abstract).
"""
from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

PAD_ID, MASK_ID = 0, 4


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_layers: int
    intermediate_size: int
    max_position: int
    batch: int
    seq_len: int
    dropout: float = 0.1
    lr: float = 1e-4
    warmup_steps: int = 10_000
    total_steps: int = 1_000_000
    weight_decay: float = 0.01


CONFIGS = {
    "tiny": Config(vocab_size=512, hidden_size=64, num_heads=4, num_layers=2,
                   intermediate_size=256, max_position=64, batch=16, seq_len=32,
                   lr=1e-3, warmup_steps=1, total_steps=100),
    "paper": Config(vocab_size=30522, hidden_size=768, num_heads=12, num_layers=12,
                    intermediate_size=3072, max_position=512, batch=2048, seq_len=128),
}

dense_init = nn.initializers.normal(0.02)


class BertLayer(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        cfg = self.cfg
        attn = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads, dropout_rate=cfg.dropout, kernel_init=dense_init,
            name="attention")(x, x, mask=mask, deterministic=deterministic)
        attn = nn.Dropout(cfg.dropout)(attn, deterministic=deterministic)
        x = nn.LayerNorm(epsilon=1e-12, name="attention_layernorm")(x + attn)
        h = nn.Dense(cfg.intermediate_size, kernel_init=dense_init, name="intermediate")(x)
        h = nn.gelu(h, approximate=False)
        h = nn.Dense(cfg.hidden_size, kernel_init=dense_init, name="output")(h)
        h = nn.Dropout(cfg.dropout)(h, deterministic=deterministic)
        return nn.LayerNorm(epsilon=1e-12, name="output_layernorm")(x + h)


class BertForMaskedLM(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, input_ids, attention_mask, token_type_ids, deterministic: bool = True):
        cfg = self.cfg
        word_embeddings = nn.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=dense_init,
                                   name="word_embeddings")
        position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        x = (word_embeddings(input_ids)
             + nn.Embed(cfg.max_position, cfg.hidden_size, embedding_init=dense_init,
                        name="position_embeddings")(position_ids)
             + nn.Embed(2, cfg.hidden_size, embedding_init=dense_init,
                        name="token_type_embeddings")(token_type_ids))
        x = nn.LayerNorm(epsilon=1e-12, name="embeddings_layernorm")(x)
        x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)

        mask = nn.make_attention_mask(attention_mask > 0, attention_mask > 0)
        for i in range(cfg.num_layers):
            x = BertLayer(cfg, name=f"layer_{i}")(x, mask, deterministic)

        # MLM head: transform, then decode with the tied word embedding
        h = nn.Dense(cfg.hidden_size, kernel_init=dense_init, name="transform")(x)
        h = nn.gelu(h, approximate=False)
        h = nn.LayerNorm(epsilon=1e-12, name="transform_layernorm")(h)
        logits = word_embeddings.attend(h)
        return logits + self.param("mlm_bias", nn.initializers.zeros, (cfg.vocab_size,))


def decay_mask_fn(params):
    flat = traverse_util.flatten_dict(params)
    flat_mask = {path: path[-1] not in ("bias", "scale") for path in flat}
    return traverse_util.unflatten_dict(flat_mask)


def make_optimizer(cfg: Config):
    warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    decay = optax.linear_schedule(cfg.lr, 0.0, cfg.total_steps - cfg.warmup_steps)
    schedule = optax.join_schedules([warmup, decay], boundaries=[cfg.warmup_steps])
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-6, weight_decay=cfg.weight_decay,
                    mask=decay_mask_fn),
    )


def mlm_batch(cfg: Config, seed: int = 0) -> dict:
    """What a masking data collator hands over: 15% of the real tokens masked, padded tails."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, cfg.vocab_size, (cfg.batch, cfg.seq_len))
    lengths = rng.integers(cfg.seq_len // 2, cfg.seq_len + 1, (cfg.batch,))
    attention_mask = (np.arange(cfg.seq_len)[None, :] < lengths[:, None]).astype(np.int32)
    ids = np.where(attention_mask > 0, ids, PAD_ID)
    masked = (rng.random(ids.shape) < 0.15) & (attention_mask > 0)
    labels = np.where(masked, ids, -100)
    input_ids = np.where(masked, MASK_ID, ids)
    return {"input_ids": jnp.asarray(input_ids, jnp.int32),
            "attention_mask": jnp.asarray(attention_mask, jnp.int32),
            "token_type_ids": jnp.zeros(ids.shape, jnp.int32),
            "labels": jnp.asarray(labels, jnp.int32)}


def make(size: str = "tiny"):
    cfg = CONFIGS[size]
    model = BertForMaskedLM(cfg)
    tx = make_optimizer(cfg)

    def init(rng, batch):
        return model.init(rng, batch["input_ids"], batch["attention_mask"],
                          batch["token_type_ids"], deterministic=True)["params"]

    def train_step(params, opt_state, dropout_rng, batch):
        dropout_rng, new_dropout_rng = jax.random.split(dropout_rng)
        labels = batch.pop("labels")

        def loss_fn(params):
            logits = model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                                 batch["token_type_ids"], deterministic=False,
                                 rngs={"dropout": dropout_rng})
            label_mask = jnp.where(labels > 0, 1.0, 0.0)
            loss = optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, logits.shape[-1]))
            return (loss * label_mask).sum() / label_mask.sum()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, new_dropout_rng, loss

    rng = jax.random.PRNGKey(0)
    if size == "tiny":
        batch = mlm_batch(cfg)
        params = jax.jit(init)(rng, batch)
        opt_state = tx.init(params)
        dropout_rng = jax.random.PRNGKey(1)
    else:
        shape = (cfg.batch, cfg.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32)
                 for k in ("input_ids", "attention_mask", "token_type_ids", "labels")}
        params = jax.eval_shape(init, rng, batch)
        opt_state = jax.eval_shape(tx.init, params)
        dropout_rng = jax.eval_shape(jax.random.PRNGKey, 1)
    return train_step, (params, opt_state, dropout_rng, batch)
