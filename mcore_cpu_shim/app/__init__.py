"""The application: the command line and what its commands run.

``cli`` parses ``mcore-cpu-shim COMMAND``; each command is a module (``convert``, ``demo``,
``doctor``, ``run``). ``convert`` and ``demo`` do their work in ranks: ``launch`` starts them
through torch's elastic agent (``agent``, a process of its own) and follows them, ``worker``
is each rank's side (its life and the one event format), and ``convert_worker``,
``demo_worker`` and ``demo_bridge`` are what the ranks run. ``inputs`` checks convert's input
before any work, ``passes`` runs the demo's groups of ranks, ``demo_report`` says what they
found, ``hf_models`` writes the tiny Hugging Face models of the demo and the tests.

Imports flow one way: the application uses the core (the engine, the fixes, the TE import
guard, the tripwire), the core never imports the application. Nothing here imports torch at
module level.
"""
