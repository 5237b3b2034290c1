"""The data preparation job: raw text in, the packed dataset training reads out (``python -m gpuscout_data``).

prepare.py runs the pipeline; sources.py reads documents; tokenizer.py builds and applies the tokenizer; dataset.py
is the format on disk, shared with gpuscout_train.
"""
