"""Hugging Face's "Fine-tune a pretrained model" tutorial, its native PyTorch loop: a DataLoader over a tokenized
dataset (dicts of tensors) with a short last batch, ``outputs = model(**batch)``, ``outputs.loss.backward()``, AdamW
with ``get_scheduler("linear", ...)`` stepped every batch, then the evaluation loop (``model.eval()``,
``torch.no_grad()``, ``argmax`` of ``outputs.logits``). A tiny BERT built from a config (dropout off). Through
OptimizedDDP the losses, weights and predictions are plain torch's within 1e-4."""

import numpy as np
import pytest
import torch
from _torch_harness import assert_state_close, optimized, plain
from torch.utils.data import DataLoader

pytestmark = pytest.mark.torch  # needs the torch extra

transformers = pytest.importorskip("transformers")


def tokenized_dataset(n, seed):
    """What ``dataset.map(tokenize_function)`` then ``set_format("torch")`` yields: one dict of tensors per row;
    the label is whether token 5 appears in the text."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(6, 13, (1,), generator=g))
        ids = torch.zeros(12, dtype=torch.long)
        ids[:length] = torch.randint(1, 40, (length,), generator=g)
        mask = (torch.arange(12) < length).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(int((ids == 5).any()))})
    return rows


def main(wrap):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    train_dataloader = DataLoader(tokenized_dataset(40, seed=1), shuffle=False, batch_size=16)  # 16, 16, 8
    eval_dataloader = DataLoader(tokenized_dataset(20, seed=2), batch_size=16)  # 16, 4
    model = wrap(transformers.BertForSequenceClassification(config))  # the DDP line
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    num_epochs = 2
    num_training_steps = num_epochs * len(train_dataloader)
    lr_scheduler = transformers.get_scheduler(
        name="linear", optimizer=optimizer, num_warmup_steps=1, num_training_steps=num_training_steps
    )
    model.train()
    losses = []
    for _epoch in range(num_epochs):
        for batch in train_dataloader:
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    model.eval()
    predictions = []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        logits = outputs.logits
        predictions.append(torch.argmax(logits, dim=-1))
    return model.state_dict(), losses, torch.cat(predictions)


@pytest.mark.slow  # ~30 s on two shared CPU cores
@pytest.mark.timeout(900)
def test_hugging_face_fine_tune_loop_as_plain_torch():
    expected_state, expected, expected_predictions = main(plain)
    state, losses, predictions = main(optimized)
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert_state_close(state, expected_state)
    torch.testing.assert_close(predictions, expected_predictions)
