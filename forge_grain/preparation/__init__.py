"""Turning text (or token ids) into token stores: local preparation, the Apache Beam runner, corpora and tokenizing."""
