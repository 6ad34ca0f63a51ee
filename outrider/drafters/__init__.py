"""Drafters: anything that proposes a draft tree for the target to verify.

    base.py           the protocol (start, propose, update, finish) and the draft budget
    capabilities.py   what a drafter declares: tree kinds, gives_probs, siblings, needs_hidden
    registry.py       drafters by name: argument parser, capabilities, fit check, build
    ngram.py, suffix.py (+ suffix_tree.py)       training-free lookups
    model.py          ModelDrafter, the drafting loop of a Decoder; draft_model.py and
                      early_exit.py register it as `draft-model:NAME` and `early-exit:K`
"""
