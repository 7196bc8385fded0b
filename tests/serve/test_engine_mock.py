"""The engine's bookkeeping against a scripted mock model: every row's cache holds exactly its own
tokens in order, whatever joins, leaves, shifts or resizes around it.

The mock's next token is a position-weighted hash of every token its row can see (the keys the
mask lets through, in buffer order), so a row that saw one token too many or too few, in the
wrong order, or another row's, decodes something else than its script.
"""

import random

import pytest
import torch

from llm import DynamicCache, GenerationConfig, MosaicGPTConfig
from llm.model import CausalLMOutput
from llm.serve import Engine, QueueFull

VOCAB = 50
EOS = 0


def script(tokens: list[int]) -> int:
    """The mock's next token after ``tokens``."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + len(tokens)) % VOCAB


def scripted(prompt: list[int], max_new_tokens: int) -> list[int]:
    """What the engine must return: the script continued until eos or max_new_tokens."""
    seq, out = list(prompt), []
    while len(out) < max_new_tokens:
        out.append(script(seq))
        seq.append(out[-1])
        if out[-1] == EOS:
            break
    return out


def one_hot(tokens: list[int]) -> torch.Tensor:
    logits = torch.zeros(VOCAB)
    logits[script(tokens)] = 10.0
    return logits


class MockModel:
    """One layer, one key head of size one holding the token id; logits say ``script`` of what is seen."""

    def __init__(self):
        self.config = MosaicGPTConfig(vocab_size=VOCAB, d_model=2, n_heads=2, n_layers=1, max_seq_len=4096,
                                      learned_pos_emb=False, alibi=True)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.training, self.blocks = False, ()  # no attention of torch's: reads only the visible keys
        self.forwards = 0

    def __call__(self, input_ids, past_key_values, use_cache, logits_to_keep):
        self.forwards += 1
        keys = input_ids.float()[:, None, :, None]
        k, _ = past_key_values.update(keys, keys, 0)
        seen = k[0, 0, :, 0].long().tolist()
        return CausalLMOutput(logits=one_hot(seen)[None, None])

    def forward_static(self, input_ids, cache, cache_position, key_mask, logits_index=None):
        self.forwards += 1
        cache._keys[0][:, 0, cache_position, 0] = input_ids.float()
        rows = []
        for row in range(input_ids.shape[0]):
            columns = []
            for column in cache_position.tolist():
                visible = key_mask[row, :column + 1]
                columns.append(one_hot(cache._keys[0][row, 0, :column + 1, 0][visible].long().tolist()))
            rows.append(torch.stack(columns))
        logits = torch.stack(rows)
        return logits if logits_index is None else logits.gather(1, logits_index[..., None].expand(-1, -1, VOCAB))


def options(max_new_tokens):
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=EOS)


def run(engine):
    while engine.step():
        pass


def test_rows_joining_and_leaving_at_random_steps_each_decode_their_own_script():
    random.seed(0)
    engine = Engine(MockModel(), max_batch_size=6, max_queue=100, prefix_cache_tokens=0)
    submitted = []
    for _ in range(60):
        for _ in range(random.choice([0, 0, 1, 2])):
            prompt = [random.randrange(1, VOCAB) for _ in range(random.randrange(1, 40))]
            submitted += engine.submit([(prompt, options(random.randrange(1, 60)))])
        engine.step()
    run(engine)
    assert submitted
    for sequence in submitted:
        assert sequence.tokens == scripted(sequence.prompt, sequence.options.max_new_tokens)
        assert sequence.finish_reason == ("stop" if sequence.tokens[-1] == EOS else "length")


def test_long_rows_cross_the_buffer_capacity_and_short_ones_join_long_ones():
    # 256 is the smallest buffer: these rows outgrow it, shift left and grow it while others join
    engine = Engine(MockModel(), max_batch_size=4, prefix_cache_tokens=0)
    long = engine.submit([([3] * 200, options(400))])
    for _ in range(30):
        engine.step()
    later = engine.submit([([5, 6], options(300)), (list(range(1, 45)) * 7, options(50))])
    capacities = set()
    while engine.step():
        capacities.add(engine.batch.capacity)
    for sequence in long + later:
        assert sequence.tokens == scripted(sequence.prompt, sequence.options.max_new_tokens)
    assert max(capacities) >= 512


def test_the_batch_grows_and_shrinks_its_slots_with_the_rows():
    engine = Engine(MockModel(), max_batch_size=8, prefix_cache_tokens=0)
    short = engine.submit([([i], options(3)) for i in range(1, 7)])
    long = engine.submit([([9, 9], options(40))])
    engine.step()
    assert len(engine.batch.rows) == 8
    run(engine)
    assert len(engine.batch.rows) == 1  # shrank once the short rows left
    for sequence in short + long:
        assert sequence.tokens == scripted(sequence.prompt, sequence.options.max_new_tokens)


def test_a_prompt_that_starts_with_a_computed_sequence_runs_only_its_new_tokens():
    model = MockModel()
    engine = Engine(model, prefix_cache_tokens=1000)
    system = [7] * 30
    (first,) = engine.submit([(system + [1, 2], options(5))])
    run(engine)
    # the next turn: the first one's prompt and answer, then a new message
    follow = first.prompt + first.tokens + [3, 4]
    (second,) = engine.submit([(follow, options(5))])
    (other,) = engine.submit([(system + [8], options(5))])
    run(engine)
    assert second.cached_tokens == len(first.prompt) + len(first.tokens) - 1  # its last token was never fed
    assert other.cached_tokens == len(system)
    for sequence in (first, second, other):
        assert sequence.tokens == scripted(sequence.prompt, 5)
    assert engine.prefix.hits == 2


def test_the_prefix_cache_stays_within_its_token_budget():
    engine = Engine(MockModel(), prefix_cache_tokens=100)
    for i in range(1, 20):
        engine.submit([([i] * 30, options(2))])
        run(engine)
        assert engine.prefix.tokens <= 100
    assert len(engine.prefix) == 3  # the three most recent, 31 positions each


def test_a_cancelled_row_is_freed_at_the_next_step_and_the_others_go_on():
    engine = Engine(MockModel(), max_batch_size=2, prefix_cache_tokens=0)
    gone, kept = engine.submit([([4, 4], options(100)), ([6], options(30))])
    waiting = engine.submit([([8], options(4))])[0]
    engine.step()
    assert engine.running == 2 and engine.waiting == 1
    gone.cancel()
    engine.step()
    assert gone.finish_reason == "cancelled" and len(gone.tokens) == 2
    assert waiting.tokens  # it took the freed slot
    run(engine)
    assert kept.tokens == scripted([6], 30) and waiting.tokens == scripted([8], 4)


def test_a_full_queue_refuses_new_requests_whole_and_takes_them_again_once_drained():
    engine = Engine(MockModel(), max_batch_size=1, max_queue=3, prefix_cache_tokens=0)
    engine.submit([([1], options(5))] * 3)
    with pytest.raises(QueueFull, match="3 sequences are waiting"):
        engine.submit([([2], options(5))])
    engine.step()  # one admitted: room for one
    with pytest.raises(QueueFull):
        engine.submit([([2], options(5))] * 2)
    assert engine.waiting == 2
    run(engine)
    (late,) = engine.submit([([2], options(5))])
    run(engine)
    assert late.tokens == scripted([2], 5)


def test_the_callback_gets_every_token_once_in_order_with_the_finish_reason_last():
    events = []
    engine = Engine(MockModel(), prefix_cache_tokens=0)
    a, b = engine.submit([([1, 2], options(6)), ([3], options(4))],
                         callback=lambda s, tokens, reason: events.append((s.id, tokens, reason)))
    run(engine)
    for sequence in (a, b):
        mine = [(tokens, reason) for i, tokens, reason in events if i == sequence.id]
        assert [t for tokens, _ in mine for t in tokens] == sequence.tokens
        assert all(reason is None for _, reason in mine[:-1]) and mine[-1][1] == sequence.finish_reason


def test_bad_submissions_are_refused_before_anything_runs():
    engine = Engine(MockModel())
    with pytest.raises(ValueError, match="empty"):
        engine.submit([([], options(3))])
    with pytest.raises(ValueError, match="token id 50"):
        engine.submit([([1, 50], options(3))])
    with pytest.raises(ValueError, match="stop strings need"):
        engine.submit([([1], options(3).update(stop_strings="x"))])
    assert engine.waiting == 0


class FlakyModel(MockModel):
    """Fails every prefill that holds a 13-token prompt, alone or beside others."""

    def __call__(self, input_ids, *args, **kwargs):
        if input_ids.shape[1] == 13:
            raise RuntimeError("boom")
        return super().__call__(input_ids, *args, **kwargs)

    def forward_static(self, input_ids, *args, **kwargs):
        if input_ids.shape[1] == 13:
            raise RuntimeError("boom")
        return super().forward_static(input_ids, *args, **kwargs)


def test_a_failing_prefill_fails_only_its_request():
    engine = Engine(FlakyModel(), prefix_cache_tokens=0)
    bad, good = engine.submit([([1] * 13, options(3)), ([2] * 3, options(3))])
    run(engine)
    assert bad.finish_reason == "error" and "boom" in bad.error
    assert good.tokens == scripted([2] * 3, 3)


def test_dynamic_cache_of_the_mock_matches_the_script():
    # the mock itself: its prefill continues a given cache
    model, cache = MockModel(), DynamicCache()
    model(torch.tensor([[1, 2]]), cache, True, 1)
    out = model(torch.tensor([[3]]), cache, True, 1)
    assert int(out.logits[0, -1].argmax()) == script([1, 2, 3])


def test_prompts_admitted_together_are_prefilled_in_one_forward():
    # three new prompts of different lengths (one after a cached prefix) go through one forward;
    # one that repeats most of a prompt beside it waits for that one's keys and values, then
    # takes them from the prefix cache in the same step and joins with only its last token to feed
    model = MockModel()
    engine = Engine(model, max_batch_size=8, prefix_cache_tokens=1000)
    (warm,) = engine.submit([([4] * 6, options(1))])
    run(engine)
    prompts = [[4] * 6 + [1, 2, 3], [5] * 11, [6, 7], [5] * 11 + [8]]
    sequences = engine.submit([(p, options(4)) for p in prompts])
    model.forwards = 0
    engine.step()
    assert model.forwards == 2  # the prompts' forward, then the batch's step
    assert [len(s.tokens) for s in sequences] == [2, 2, 2, 1]  # the last one joined to feed its last token
    assert [s.cached_tokens for s in sequences] == [6, 0, 0, 11]
    run(engine)
    for sequence in [warm, *sequences]:
        assert sequence.tokens == scripted(sequence.prompt, sequence.options.max_new_tokens)


def test_a_short_prompt_behind_a_long_one_waits_one_step_and_the_long_one_moves_on():
    # head-of-line blocking: the long prompt's prefill takes many steps; a short prompt that
    # arrives during it is prefilled whole at the next step, and the long one still gets at
    # least a quarter of every step's chunk
    engine = Engine(MockModel(), max_batch_size=4, prefix_cache_tokens=0, prefill_chunk=16)
    (long,) = engine.submit([([1 + i % 40 for i in range(99)], options(3))])
    engine.step()
    assert long.prefilled == 16
    shorts = []
    for step in range(3):
        (short,) = engine.submit([([41 + step] * 12, options(2))])
        before = long.prefilled
        engine.step()
        assert short.tokens and long.prefilled == before + 4  # 12 + 4 = the chunk
        shorts.append(short)
    run(engine)
    for sequence in [long, *shorts]:
        assert sequence.tokens == scripted(sequence.prompt, sequence.options.max_new_tokens)
