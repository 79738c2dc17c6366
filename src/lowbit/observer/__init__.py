"""Observers: identity modules that record statistics and turn them into qparams.

``from lowbit.observer import HistogramObserver`` works as in the seeds.
"""

from .base import ObserverBase
from .distributed import sync_observers
from .entropy import EntropyObserver
from .fixed import FixedQParamsObserver, NoopObserver, PlaceholderObserver
from .histogram import HistogramObserver
from .recording import RecordingObserver, get_observer_dict
from .state import get_observer_state_dict, load_observer_state_dict
from .minmax import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)
from .mse import MSEObserver
from .percentile import PercentileObserver

__all__ = ["ObserverBase", "MinMaxObserver", "MovingAverageMinMaxObserver", "PerChannelMinMaxObserver",
           "MovingAveragePerChannelMinMaxObserver", "FixedQParamsObserver", "PlaceholderObserver", "NoopObserver",
           "sync_observers", "HistogramObserver", "RecordingObserver", "get_observer_dict",
           "get_observer_state_dict", "load_observer_state_dict", "PercentileObserver", "EntropyObserver", "MSEObserver"]
