"""`salience repl`, an LMTP client for people at a terminal (docs/repl.md).

console.py is the loop (`run_repl`); parsing.py reads a line's `key=value` parameters and the
commands' arguments, chat.py keeps chat mode's conversation, readouts.py and features.py choose
and print `/readout` and `/features`, constraints.py turns `/json`, `/regex`, `/choice` and
`/grammar` into LMTP's `structured_outputs`, display.py prints `/help`, a stream's ending and
`/concepts`. A client: it imports no server code.
"""
