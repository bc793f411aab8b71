"""KV-capacity admission: bookings on decode workers in Redis, credit, the wait queue, lease renewal."""

from pdrouter.router.admission.admission import Admission
from pdrouter.router.admission.config import AdmissionConfig, AdmissionStats

__all__ = ["Admission", "AdmissionConfig", "AdmissionStats"]
