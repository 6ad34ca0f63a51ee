"""Drafters: anything that proposes a draft tree for the target to verify.

    base.py           the protocol (every hook the engine calls) and DrafterBase, their defaults
    capabilities.py   what a drafter declares: tree kinds, gives_probs, siblings, needs_hidden,
                      needs_attention
    registry.py       drafters by name: argument parser, capabilities, fit check, build
    ngram.py, suffix.py (+ suffix_tree.py)       training-free lookups
    model.py          ModelDrafter, the drafting loop of a Decoder (model_growers.py: each tree
                      shape grown); draft_model.py and early_exit.py register it as
                      `draft-model:NAME` and `early-exit:K`; s2moe.py as `s2moe:K'` (the MoE
                      target routing fewer experts a token: S2-MoE's expert skip)
    eagle3.py         an EAGLE-3 head drafting from the target's features (heads/eagle3/head.py;
                      its trees grown by model_growers.py too); eagle3_options.py its argument
    dflash.py         a DFlash block head: a whole block per forward (heads/dflash/head.py)
    block.py          a drafted block and its trees: argmax and sampled chains, DDTree
    refiners/         block refiners (ReTrace, CURE, DARTree, LiLiCorr): block -> draft tree
    hybrid.py, oilbird.py (+ oilbird_base.py), ooo.py, toolspec.py (+ toolspec_fsm.py,
    toolspec_schema.py), sparsespec.py (+ sparsespec_select.py), window.py
                      the other methods (docs/methods.md)
    merge.py          paths added to a lexical drafter's tree under its node budget
    grow.py, slots.py, siblings.py, pending.py                 batched drafting helpers
"""
