"""Dispatch by measured speed: the shapes ``mhattn tune`` times (:mod:`.grid`), timing one shape
(:mod:`.measure`), the timing tables and the nearest-shape lookup the dispatcher makes (:mod:`.table`)
and the command (:mod:`.cli`)."""
