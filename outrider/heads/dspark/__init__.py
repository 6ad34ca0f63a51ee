"""The DSpark head kind: the DFlash backbone, the anchor a prediction, a Markov head and a confidence head.

    head.py         the runtime head (backbone pass, one Markov step, confidence)   reference.py  the slow one
    markov.py       the Markov head (vanilla, gated, rnn; rank r) and the confidence head
    calibrate.py    per-position temperatures (left to right, ECE of the cumulative products)
    format.py       its layout on disk (DeepSpec's Qwen3DSparkModel config + our names)
    export.py       writing it                            check.py   `outrider check-head`
    golden.py       its golden (tau and per-slot argmaxes on fixed inputs)
    trainable.py    the module `outrider train dspark` trains, and its job     cli.py   `outrider export dspark`

The drafter that runs it is drafters/dspark.py (the prefix scheduler: drafters/dspark_schedule.py);
its registration as a head kind, heads/kinds.py.
"""
