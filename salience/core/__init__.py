"""Salience's core: everything between the frontends and vLLM, with no socket in it.

Four subpackages, each importing only those below it (tests/test_architecture.py checks it):

    serving   lifecycle and admission, sessions and turns, jobs that drive an engine
    engine    vLLM behind a small typed interface: requests, checks, launch, the worker extension
    probes    concept sets, the taps in the model's graph, readouts and steering, worker side included
    models    model folders on disk: conversion, the default model, the home directory

Outside itself, core imports only `salience.errors`, the one error taxonomy every frontend
translates. docs/architecture.md is the map.
"""
