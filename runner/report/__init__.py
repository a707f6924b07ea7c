"""`kvcache report`: a run's metrics file summarised as text (summary.py), where the time went
(time_split.py), a disaggregated run's two workers on one timeline (pd_timeline.py), and one
HTML page of pictures (html.py). The file's shapes, as types: metrics_file.py; the fields
checked before anything is computed: fields.py.

May import: nothing else of the project: it reads metrics files, never an engine.
"""
