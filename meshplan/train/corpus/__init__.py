"""The embedded training corpus: ``corpus.txt`` (about 1 MB of ASCII text written by
`meshplan.train.corpus.generate`), the default data of ``meshplan train``. See README.md here
for its origin and licence.
"""
