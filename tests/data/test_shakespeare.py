import re

import pytest

from llm.data import VALIDATION_PLAYS, load_corpus, markdown_to_text, play_paths, split_plays

SAMPLE_MD = """\
# Twelfth Night

## ACT I

### SCENE I. DUKE ORSINO's palace.

_Enter DUKE ORSINO, CURIO, and other Lords; Musicians attending_

**DUKE ORSINO**  
If music be the food of love, play on;  
Give me excess of it, that, surfeiting,  
The appetite may sicken, and so die.

_Enter VALENTINE_

How now! what news from her?

*Enter King Edward, Derby, Prince Edward, Audley, and 
Artois.*

**PAGE**  
[Within]_  
Who's there?

**BOTTOM**  
__\\[Awaking]_  
When my cue comes, call me, and I will answer \\--odours;  
And thanks; and ever _\\[ ]_  
_Re-enter ULYSSES_

#### SCENE II. The sea-coast.

_Exeunt_
"""

SAMPLE_TEXT = """\
Twelfth Night

ACT I

SCENE I. DUKE ORSINO's palace.

[Enter DUKE ORSINO, CURIO, and other Lords; Musicians attending]

DUKE ORSINO:
If music be the food of love, play on;
Give me excess of it, that, surfeiting,
The appetite may sicken, and so die.

[Enter VALENTINE]

How now! what news from her?

[Enter King Edward, Derby, Prince Edward, Audley, and Artois.]

PAGE:
[Within]
Who's there?

BOTTOM:
[Awaking]
When my cue comes, call me, and I will answer --odours;
And thanks; and ever [ ]
[Re-enter ULYSSES]

SCENE II. The sea-coast.

[Exeunt]
"""


def test_markdown_to_text_sample():
    assert markdown_to_text(SAMPLE_MD) == SAMPLE_TEXT


def test_markdown_to_text_real_play():
    text = markdown_to_text(play_paths()["hamlet"].read_text(encoding="utf-8"))
    assert text.startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore. A platform before the castle.\n\n")
    assert "\nHAMLET:\nTo be, or not to be: that is the question:\n" in text
    assert "\n[Enter HORATIO and MARCELLUS]\n" in text
    for markup in ("**", "_", "#", "*", "\\"):
        assert markup not in text
    assert not re.search(r" +\n", text)


def test_no_markup_left_in_any_play(train_text, validation_text):
    assert re.findall(r"[*_#\\`<>|]", train_text + validation_text) == []


def test_splits_are_disjoint_by_play(train_text, validation_text):
    train, validation = split_plays("train"), split_plays("validation")
    assert validation == sorted(VALIDATION_PLAYS)
    assert set(train).isdisjoint(validation)
    assert sorted(train + validation) == sorted(play_paths())
    assert len(train) == 34
    # Each play's title opens its text, so each title is in exactly one split.
    assert validation_text.startswith("Hamlet\n\nACT I\n")
    assert "\n\nTwelfth Night\n\nACT I\n" in validation_text
    assert "\n\nTwelfth Night\n\nACT I\n" not in train_text
    assert "\n\nMacbeth\n\nACT I\n" in train_text
    assert 0.08 < len(validation_text) / (len(train_text) + len(validation_text)) < 0.12


def test_load_corpus_joins_sorted_plays_with_blank_line(validation_text):
    paths = play_paths()
    plays = [markdown_to_text(paths[name].read_text(encoding="utf-8")) for name in sorted(VALIDATION_PLAYS)]
    assert validation_text == "\n".join(plays)
    assert "\n\nThe Tempest\n\nACT I\n" in validation_text


def test_load_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="'train', 'validation'"):
        load_corpus("test")
    with pytest.raises(FileNotFoundError, match="make data"):
        load_corpus("train", plays_dir=tmp_path)
