"""Accuracy at a KV budget: kvpress's evaluation with our presses (:mod:`.launch`), offline RULER-style data on real
text (:mod:`.ruler_data`), and the results run over presses × budgets × tasks (:mod:`.results`)."""
